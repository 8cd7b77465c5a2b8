"""A `serve` app's shared models for tests that never reach a call's pipeline: a tiny random LLM
engine, no ASR or TTS, so the server is 'ready' without loading the embedded models."""

from __future__ import annotations

import threading

from llm_engine.config import EngineConfig, SpeculationConfig
from llm_engine.contract import make_pair_card
from llm_engine.engine import SpeculativeEngine
from llm_engine.loading import LoadedModel
from tests.llm_engine.tiny_models import break_forward, make_model, make_tokenizer
from voiceagent.llm_setup import LLMRuntime
from voiceagent.pipeline.builder import SharedModels


def tiny_shared(break_on: threading.Event | None = None, method: str = "off",
                eos: bool = True, restarts: int = 0) -> SharedModels:
    """With `break_on`: the engine's forward raises SystemExit once it is set. `eos=False`: a
    reply runs to its budget (a random model may end one at any token). `restarts`: the
    engine worker's (`engine.worker_restarts`)."""
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer))
    config = EngineConfig(speculation=SpeculationConfig(method=method, gate=False))
    target = LoadedModel("tiny", "/models/tiny", None, None, None, model, tokenizer, "cpu",
                         "float32", sum(p.numel() * 4 for p in model.parameters()), 0.0, False)
    engine = SpeculativeEngine(model, tokenizer, config, eos_token_ids=None if eos else set())
    if break_on is not None:
        # SystemExit (a library calling sys.exit() mid-forward) is what no `except Exception`
        # catches.
        break_forward(model, SystemExit("exit called mid-forward"), break_on)
    llm = LLMRuntime(target, None, make_pair_card(target, None, config, target.param_bytes),
                     engine)
    return SharedModels(llm=llm, worker=llm.serve(restarts))
