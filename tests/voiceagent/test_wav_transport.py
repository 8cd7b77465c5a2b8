"""The simulated phone line's caller: paced audio, and a caller who waits to hear the bot."""

import asyncio

import numpy as np
from pipecat.transports.base_transport import TransportParams

from voiceagent.pipeline import wav_transport
from voiceagent.pipeline.wav_transport import FRAME_S, CallClock, WavCallInput

RATE = 16000
N = int(RATE * FRAME_S)  # samples a frame


async def test_a_caller_waits_at_the_given_point_until_they_have_heard_the_bot():
    said = np.arange(1, 4 * N + 1, dtype=np.int16)  # four frames, no sample zero
    heard = [0.0]
    line = WavCallInput(said, RATE, CallClock(), TransportParams(audio_in_sample_rate=RATE),
                        realtime=False, after_bot={2 * N: 1.5}, heard=lambda: heard[0])
    frames: list[np.ndarray] = []

    async def push(frame):
        frames.append(np.frombuffer(frame.audio, dtype=np.int16))

    line.push_audio_frame = push
    feeder = asyncio.create_task(line._feed())
    try:
        while len(frames) < 20:
            await asyncio.sleep(0)
        assert [f[0] for f in frames[:2]] == [1, N + 1]  # the first two frames as said
        assert not any(f.any() for f in frames[2:20])  # then silence: the bot not heard yet
        assert not line.audio_done.is_set()
        await asyncio.sleep(0.01)  # the caller waits on: a silence of its own in the record
        heard[0] = 1.5
        while not line.audio_done.is_set():
            await asyncio.sleep(0)
    finally:
        feeder.cancel()
    spoken = [f for f in frames if f.any()]
    assert np.array_equal(np.concatenate(spoken), said)  # every sample, in order, once
    sent = line.as_sent()  # what the call's record holds: the wait's silence in its place
    assert np.array_equal(sent[:2 * N], said[:2 * N])
    assert np.array_equal(sent[-2 * N:], said[2 * N:])
    assert len(sent) > len(said) and not sent[2 * N:-2 * N].any()


async def test_a_bot_that_never_speaks_does_not_hold_the_caller_for_ever(monkeypatch):
    monkeypatch.setattr(wav_transport, "MAX_WAIT_S", 0.05)
    said = np.ones(2 * N, dtype=np.int16)
    line = WavCallInput(said, RATE, CallClock(), TransportParams(audio_in_sample_rate=RATE),
                        realtime=False, after_bot={N: 1.0}, heard=lambda: 0.0)

    async def push(frame):
        await asyncio.sleep(0.001)

    line.push_audio_frame = push
    feeder = asyncio.create_task(line._feed())
    try:
        await asyncio.wait_for(line.audio_done.wait(), 5)
    finally:
        feeder.cancel()
    assert line.waited[N] >= 0.05
