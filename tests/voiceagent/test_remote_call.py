"""A whole simulated call whose LLM is a remote OpenAI-compatible server: `voiceagent serve` in
another process, reached through its `/v1` (llm.backend: openai). The three clocks, the stored
method and the remote's per-request speculation come out as they do in process."""

from __future__ import annotations

import numpy as np
import pytest

from tests.audio.speech import silence, speech
from tests.voiceagent.server_proc import running_server
from voiceagent.config import load_config
from voiceagent.dashboard.store import open_store
from voiceagent.pipeline.builder import load_shared
from voiceagent.sim.call import simulate_call

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def remote_url(tmp_path_factory):
    runs = tmp_path_factory.mktemp("remote-runs")
    with running_server("--set", f"paths.runs_dir={runs}") as base:
        yield f"{base}/v1"


async def test_a_call_on_a_remote_llm_has_its_clocks_method_and_speculation(
        remote_url, tmp_path):
    cfg = load_config(None, [f"paths.runs_dir={tmp_path}", "llm.backend=openai",
                             f"llm.base_url={remote_url}", "llm.name=serve-ngram"])
    shared = load_shared(cfg, progress=lambda _: None)
    assert shared.worker is None  # no local LLM loaded
    # 10 s: the first reply is heard before the caller goes on even on a loaded machine.
    audio = np.concatenate([silence(0.5), speech("What is the capital of France?"), silence(10.0),
                            speech("And what about Spain?"), silence(5.0)])
    store = open_store(cfg)
    try:
        result = await simulate_call(cfg, shared, audio, store=store)
    finally:
        store.close()
        shared.close()
    first, second = result.turns
    for turn in (first, second):
        assert turn.llm_text.strip() and turn.bot_text.strip()
        assert turn.clocks.request_to_first_token_ms > 0
        assert turn.clocks.itl_ms.p50 is not None
        assert 0 < turn.clocks.turn_end_to_first_audio_ms < 10_000
        assert turn.engine.method == "serve-ngram"
        assert turn.engine.steps  # the remote engine's own steps and acceptance
    # The call's session id travels as OpenAI's `user`: the remote reused turn 1's KV.
    assert second.engine.reused_prefix_tokens > 0
    store = open_store(cfg)  # a fresh reader: the call was committed
    try:
        assert store.call(first.call_id)["call"]["method"] == "serve-ngram"
    finally:
        store.close()
