"""HeldReplyGate in pipecat's run_test harness: hand-built TTS output, no models."""

from __future__ import annotations

import asyncio

from pipecat.frames.frames import (
    EagerEndOfTurnCancelFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    MetricsFrame,
    TTSAudioRawFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.tests.utils import SleepFrame, run_test

from voiceagent.pipeline.frames import PreparedResponseStartFrame
from voiceagent.pipeline.held_reply import HeldReplyGate
from voiceagent.pipeline.metrics import HeldAudioMetricsData

RATE = 16000


def _audio(seconds: float) -> TTSAudioRawFrame:
    return TTSAudioRawFrame(audio=bytes(2 * int(RATE * seconds)), sample_rate=RATE,
                            num_channels=1, context_id="c")


def _reply(start) -> list:
    return [start, _audio(0.25), _audio(0.25), LLMFullResponseEndFrame()]


async def _run(frames) -> list:
    down, _ = await asyncio.wait_for(run_test(HeldReplyGate(), frames_to_send=frames), 30)
    return down


async def test_prepared_reply_is_held_until_its_turn_is_confirmed():
    down = await _run([UserStartedSpeakingFrame(), *_reply(PreparedResponseStartFrame()),
                       SleepFrame(sleep=0.1), UserStoppedSpeakingFrame()])
    kinds = [type(f) for f in down]
    stop = kinds.index(UserStoppedSpeakingFrame)
    assert TTSAudioRawFrame not in kinds[:stop]  # nothing played before the commit
    assert kinds[stop + 1 :].count(TTSAudioRawFrame) == 2  # then all of it, at once


async def test_withdrawn_prepared_reply_is_dropped_and_its_audio_reported():
    down = await _run([UserStartedSpeakingFrame(), *_reply(PreparedResponseStartFrame()),
                       SleepFrame(sleep=0.1), EagerEndOfTurnCancelFrame(),
                       *_reply(LLMFullResponseStartFrame()), UserStoppedSpeakingFrame()])
    assert sum(isinstance(f, TTSAudioRawFrame) for f in down) == 2  # only the second reply
    [dropped] = [d for f in down if isinstance(f, MetricsFrame) for d in f.data
                 if isinstance(d, HeldAudioMetricsData)]
    assert dropped.discarded_audio_ms == 500.0


async def test_ordinary_reply_passes_at_once():
    down = await _run([UserStartedSpeakingFrame(), *_reply(LLMFullResponseStartFrame())])
    assert sum(isinstance(f, TTSAudioRawFrame) for f in down) == 2
