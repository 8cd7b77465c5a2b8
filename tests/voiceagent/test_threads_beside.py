"""The engine's thread count while speech is recognised (`threads_beside`), on a tiny model."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from llm_engine import threads
from llm_engine.config import EngineConfig
from llm_engine.contract import make_pair_card
from llm_engine.engine import SpeculativeEngine
from llm_engine.loading import LoadedModel
from tests.llm_engine.tiny_models import make_model, make_tokenizer
from voiceagent import llm_setup
from voiceagent.config import Config
from voiceagent.llm_setup import LLMRuntime, threads_beside
from voiceagent.pipeline.speech_models import decoding_load

LOAD = threads.Load("speech", contextlib.nullcontext)


@pytest.fixture
def runtime():
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer))
    config = EngineConfig()
    target = LoadedModel("tiny", "/models/tiny", None, None, None, model, tokenizer, "cpu",
                         "float32", 0, 0.0, False)
    before = torch.get_num_threads()
    yield LLMRuntime(target, None, make_pair_card(target, None, config, 0),
                     SpeculativeEngine(model, tokenizer, config), threads=2)
    torch.set_num_threads(before)


@pytest.fixture
def measured_one(monkeypatch):
    """The measurement beside the load picks 1 thread."""
    monkeypatch.setattr(llm_setup, "_choose_threads", lambda *args, **kwargs: {"chosen": 1})


@pytest.mark.parametrize("identical, used", [(True, 1), (False, None)])
def test_a_count_beside_speech_is_used_only_where_its_logits_are_the_engines(
        runtime, measured_one, monkeypatch, tmp_path, identical, used):
    compared = []
    monkeypatch.setattr(threads, "identical_logits",
                        lambda runner, counts, *args: compared.append(counts) or identical)
    said = []
    assert threads_beside(EngineConfig(), runtime, str(tmp_path), LOAD, said.append) == used
    assert threads_beside(EngineConfig(), runtime, str(tmp_path), LOAD, said.append) == used
    assert compared == [[1, 2]]  # once: the answer is cached
    assert torch.get_num_threads() == 2  # the engine's own count, whatever was measured
    assert identical or "logits on 1 differ" in said[-1]


def test_no_count_beside_speech_where_a_sampling_drafter_is_loaded(runtime, measured_one,
                                                                      tmp_path):
    said = []
    with_draft = dataclasses.replace(runtime, draft=runtime.target)
    assert threads_beside(EngineConfig(), with_draft, str(tmp_path), LOAD, said.append) is None
    assert "a drafter is loaded" in said[-1]


def test_no_count_beside_speech_for_an_engine_on_one_thread(runtime, measured_one, tmp_path):
    one = dataclasses.replace(runtime, threads=1)
    assert threads_beside(EngineConfig(), one, str(tmp_path), LOAD, print) is None


def test_the_tts_load_is_named_for_how_pipers_threads_wait():
    """A thread count cached beside spinning Piper threads is not taken beside sleeping ones."""
    asleep, spinning = Config(), Config()
    spinning.tts.spin = True
    assert decoding_load(asleep, None).name != decoding_load(spinning, None).name
