"""The simulated phone line's caller: paced audio, and a caller who waits to hear the bot."""

import asyncio

import numpy as np
from pipecat.transports.base_transport import TransportParams

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
        heard[0] = 1.5
        while not line.audio_done.is_set():
            await asyncio.sleep(0)
    finally:
        feeder.cancel()
    spoken = [f for f in frames if f.any()]
    assert np.array_equal(np.concatenate(spoken), said)  # every sample, in order, once
