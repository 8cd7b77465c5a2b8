"""DTMF: keys a caller presses reach the LLM as a user turn ("DTMF: 1"), through pipecat's
DTMFAggregator, from Twilio `dtmf` events (and the call page's RTVI `dtmf`: test_browser_call)."""

from __future__ import annotations

import asyncio

import pytest
from pipecat.audio.dtmf.types import KeypadEntry
from pipecat.frames.frames import InputDTMFFrame, LLMContextFrame, TranscriptionFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMContextAggregatorPair,
    LLMUserAggregatorParams,
)
from pipecat.tests.utils import SleepFrame, run_test

from tests.voiceagent.serving import server_config, serving
from tests.voiceagent.serving import twilio_url as ws_url
from voiceagent.config import TurnConfig
from voiceagent.pipeline.builder import dtmf_aggregator
from voiceagent.pipeline.turns import load_smart_turn_session, turn_strategies
from voiceagent.server import twilio
from voiceagent.server.media_streams import ProtocolViolation, check_in_call
from voiceagent.sim.twilio_caller import TwilioCaller

REPLY_TIMEOUT_S = 45  # as test_server_twilio: one reply on a busy 2-core machine
SID = "MZdtmf"


def _dtmf(digit) -> dict:
    return {"event": "dtmf", "streamSid": SID, "dtmf": {"track": "inbound_track", "digit": digit}}


def test_a_keypad_digit_is_accepted():
    assert check_in_call(_dtmf("#"), SID) == 0


@pytest.mark.parametrize("digit", ["A", "12", "", "١"])
def test_a_digit_off_the_keypad_closes_with_1007(digit):
    # pipecat's serializer would drop it silently: the caller's key would vanish.
    with pytest.raises(ProtocolViolation) as refused:
        check_in_call(_dtmf(digit), SID)
    assert refused.value.code == 1007
    assert refused.value.reason.startswith("dtmf event without a digit")


@pytest.mark.parametrize("turn", [
    TurnConfig(), TurnConfig(prepare=False), TurnConfig(stop="smart_turn"),
    TurnConfig(min_interrupt_s=0.6, min_interrupt_words=3),
], ids=["default", "no preparation", "smart turn", "backchannel limits"])
async def test_keys_become_a_user_turn_under_our_turn_strategies(turn):
    """No VAD and no speech: the digits alone end a turn and send the context to the LLM."""
    context = LLMContext()
    smart_turn = load_smart_turn_session() if turn.stop == "smart_turn" else None
    strategies = turn_strategies(turn, smart_turn)
    pair = LLMContextAggregatorPair(
        context, user_params=LLMUserAggregatorParams(user_turn_strategies=strategies))
    keys = [InputDTMFFrame(KeypadEntry.ONE), InputDTMFFrame(KeypadEntry.POUND)]  # '#' sends
    down, _ = await asyncio.wait_for(run_test(
        Pipeline([dtmf_aggregator(turn), pair.user()]),
        frames_to_send=[*keys, SleepFrame(sleep=0.5)]), 30)
    assert any(isinstance(f, LLMContextFrame) for f in down), [type(f).__name__ for f in down]
    assert context.get_messages() == [{"role": "user", "content": "DTMF: 1#"}]


@pytest.mark.parametrize("termination,sent", [
    ("#", ["DTMF: 1#", "DTMF: 2"]), ("*", ["DTMF: 1#2"]), ("", ["DTMF: 1#2"])])
async def test_the_termination_key_sends_the_keys_at_once_the_timeout_otherwise(
        termination, sent):
    # The end of the test flushes what is held: a key that sends splits the keys in two turns.
    aggregator = dtmf_aggregator(TurnConfig(dtmf_timeout_s=5.0, dtmf_termination=termination))
    keys = [InputDTMFFrame(KeypadEntry.ONE), InputDTMFFrame(KeypadEntry.POUND),
            SleepFrame(sleep=0.3), InputDTMFFrame(KeypadEntry.TWO)]
    down, _ = await asyncio.wait_for(run_test(aggregator, frames_to_send=keys), 30)
    assert [f.text for f in down if isinstance(f, TranscriptionFrame)] == sent


@pytest.mark.slow
async def test_a_dtmf_digit_reaches_the_context_and_the_bot_answers(tmp_path, models,
                                                                    monkeypatch):
    real, built = twilio.build_call, []
    monkeypatch.setattr(twilio, "build_call",  # keeps the call's pipeline, to read its context
                        lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    async with serving(server_config(tmp_path), models) as (app, base):
        async with TwilioCaller(ws_url(base)) as caller:
            await caller.start()
            await asyncio.sleep(0.5)  # the pipeline is up
            pressed = await caller.dtmf("1")  # alone: sent after pipecat's 2 s timeout
            answered = await caller.reply(pressed, REPLY_TIMEOUT_S)
            await caller.hang_up()
        assert caller.received.close_code in (None, 1000), caller.received.close_reason
        store = app.state.server.store
        assert await asyncio.to_thread(store.flush)
        (turn,) = await asyncio.to_thread(store.turns)
    # The key press is a turn of its own on the dashboard, timed from the keys' sending.
    assert turn["user_text"] == "DTMF: 1"
    assert turn["clocks"]["turn_end_to_first_audio_ms"] > 0
    [call] = built
    messages = call.context.get_messages()
    users = [m["content"] for m in messages if m.get("role") == "user"]
    assert users == ["DTMF: 1"], messages
    assert answered is not None, "no bot audio after the key press"
    assert messages[-1].get("role") == "assistant" and messages[-1]["content"], messages
