"""`serve`'s health when the LLM engine's worker thread dies: /healthz and /metrics say so."""

from __future__ import annotations

import asyncio
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llm_engine.config import EngineConfig, SpeculationConfig
from llm_engine.contract import make_pair_card
from llm_engine.engine import SpeculativeEngine
from llm_engine.loading import LoadedModel
from tests.llm_engine.tiny_models import break_forward, make_model, make_tokenizer
from tests.voiceagent.serving import server_config
from voiceagent.llm_setup import LLMRuntime
from voiceagent.pipeline.builder import SharedModels
from voiceagent.server.app import create_app


def _tiny_shared(go: threading.Event) -> SharedModels:
    """A tiny random engine (no ASR or TTS: no call is made) whose forward raises once `go`."""
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer))
    config = EngineConfig(speculation=SpeculationConfig(method="off"))
    target = LoadedModel("tiny", "/models/tiny", None, None, None, model, tokenizer, "cpu",
                         "float32", sum(p.numel() * 4 for p in model.parameters()), 0.0, False)
    engine = SpeculativeEngine(model, tokenizer, config)
    # SystemExit (a library calling sys.exit() mid-forward) is what no `except Exception` catches.
    break_forward(model, SystemExit("exit called mid-forward"), go)
    llm = LLMRuntime(target, None, make_pair_card(target, None, config, target.param_bytes),
                     engine)
    return SharedModels(llm=llm, engine=llm.serve())


def _worker_up(metrics_text: str) -> float:
    samples = {s.name: s.value for family in text_string_to_metric_families(metrics_text)
               for s in family.samples}
    return samples["voiceagent_engine_worker_up"]


async def test_a_dead_llm_worker_makes_healthz_503_and_its_gauge_0(tmp_path):
    go = threading.Event()
    shared = _tiny_shared(go)
    app = create_app(server_config(tmp_path), shared)  # no lifespan: the models are given
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as http:
            assert (await http.get("/healthz")).json()["status"] == "ready"
            assert _worker_up((await http.get("/metrics")).text) == 1
            go.set()
            prompt = shared.llm.target.tokenizer.encode("Hello")
            failed = await asyncio.wait_for(shared.engine.generate(prompt), 5)
            health = await http.get("/healthz")
            up = _worker_up((await http.get("/metrics")).text)
    finally:
        shared.close()
    assert failed.finish_reason == "error"
    assert health.status_code == 503
    assert health.json() == {"status": "unhealthy",
                             "error": "LLM engine worker died: SystemExit: exit called mid-forward"}
    assert up == 0
