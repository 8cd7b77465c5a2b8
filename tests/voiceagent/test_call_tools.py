"""Tool calls in simulated calls through the real pipeline: the embedded models, the demo tools
(voiceagent.tools.demo) and synthesised caller speech."""

import time

import numpy as np
import pytest

from tests.audio.speech import silence, speech
from voiceagent.call import RATE, simulate_call
from voiceagent.config import load_config
from voiceagent.pipeline.builder import load_shared


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return load_config(None, [f"paths.runs_dir={tmp_path_factory.mktemp('runs')}",
                              "agent.tools=[voiceagent.tools.demo]"])


@pytest.fixture(scope="module")
def shared(cfg):
    models = load_shared(cfg, progress=lambda _: None)
    yield models
    models.close()


def _caller(*parts) -> np.ndarray:
    return np.concatenate([speech(p) if isinstance(p, str) else silence(p) for p in parts])


async def test_a_caller_asking_for_an_order_hears_its_status(cfg, shared):
    # Callers read order numbers digit by digit; Whisper writes them as one number.
    result = await simulate_call(
        cfg, shared, _caller(0.5, "What is the status of order four eight two one three?", 10.0))

    [turn] = result.turns
    [call] = turn.tool_calls
    assert call.name == "lookup_order" and call.ok
    tool = next(m for m in result.messages if m["role"] == "tool")
    assert '"status": "shipped"' in tool["content"]  # the bundled order 48213
    assert "shipped" in turn.bot_text.lower()  # and the caller hears it


async def test_saying_goodbye_ends_the_call_after_the_goodbye(cfg, shared):
    audio = _caller(0.5, "Thanks, that is all. Goodbye!", 30.0)
    start = time.monotonic()
    result = await simulate_call(cfg, shared, audio)

    assert time.monotonic() - start < len(audio) / RATE - 10, "the bot hung up, not the caller"
    [turn] = result.turns
    assert [c.name for c in turn.tool_calls] == ["end_call"]
    assert cfg.agent.goodbye in turn.bot_text
