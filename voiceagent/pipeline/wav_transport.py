"""A pipecat transport for simulated calls: caller audio from memory, bot audio onto a timeline.

Input pushes the caller's audio in 20 ms frames, at real-time pace like a phone line, then
keeps the line open with silence until the call is hung up. At given points of their audio a
caller may wait until they have heard the bot for a while (`after_bot`), so that a scripted
barge-in lands while the bot speaks however late a loaded machine starts it. Output behaves
like an audio device: each write is placed on the call's timeline at the moment it plays and
takes its duration in real time, so an interruption cuts the bot's audio where a caller would
stop hearing it.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from pipecat.frames.frames import InputAudioRawFrame, OutputAudioRawFrame, StartFrame
from pipecat.transports.base_input import BaseInputTransport
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import BaseTransport, TransportParams

from voiceagent.pipeline.frames import audio_seconds

FRAME_S = 0.02
MAX_WAIT_S = 30.0  # the longest a caller waits to hear the bot (`after_bot`)


class CallClock:
    """The call's timeline: t = 0 when the caller's first frame is sent."""

    def __init__(self) -> None:
        self.t0: float | None = None

    def now(self) -> float:
        return 0.0 if self.t0 is None else time.monotonic() - self.t0


class WavCallInput(BaseInputTransport):
    def __init__(
        self, audio: np.ndarray, sample_rate: int, clock: CallClock, params: TransportParams,
        realtime: bool = True, after_bot: dict[int, float] | None = None, heard=None,
    ):
        super().__init__(params)
        assert audio.ndim == 1 and audio.dtype == np.int16
        self._audio, self._rate, self._clock, self._realtime = audio, sample_rate, clock, realtime
        # sample index -> seconds of the bot the caller hears (`heard()`) before going on there
        self._after_bot = dict(after_bot or {})
        assert heard is not None or not self._after_bot, "after_bot needs heard()"
        self._heard = heard
        self._waiting: dict[int, float] = {}  # sample index -> call time its wait began
        self.waited: dict[int, float] = {}  # sample index -> seconds the caller waited there
        self._feeder: asyncio.Task | None = None
        self.audio_done = asyncio.Event()  # every caller sample has been sent

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)
        if self._feeder is None:
            self._feeder = self.create_task(self._feed(), name="wav-call-feeder")

    async def stop(self, frame) -> None:
        await self._stop_feeder()
        await super().stop(frame)

    async def cancel(self, frame) -> None:
        await self._stop_feeder()
        await super().cancel(frame)

    async def _stop_feeder(self) -> None:
        if self._feeder is not None:
            await self.cancel_task(self._feeder)
            self._feeder = None

    async def _feed(self) -> None:
        n = int(self._rate * FRAME_S)
        silence = bytes(2 * n)
        self._clock.t0 = time.monotonic()
        i = sent = 0  # i: the caller's frames said; sent: every frame on the line
        while True:  # after the audio, the line stays open with silence until hang-up
            chunk = self._audio[:0] if self._waits(i * n, (i + 1) * n) else \
                self._audio[i * n : (i + 1) * n]
            if len(chunk):
                i += 1
                if len(chunk) < n:
                    chunk = np.pad(chunk, (0, n - len(chunk)))
            elif i * n >= len(self._audio):
                self.audio_done.set()
            data = chunk.tobytes() if len(chunk) else silence
            await self.push_audio_frame(
                InputAudioRawFrame(audio=data, sample_rate=self._rate, num_channels=1)
            )
            sent += 1
            if self._realtime:
                await asyncio.sleep(max(0.0, self._clock.t0 + sent * FRAME_S - time.monotonic()))
            else:
                await asyncio.sleep(0)

    def _waits(self, start: int, end: int) -> bool:
        """Whether the caller, about to say samples [start, end), first waits to hear the bot
        (that many seconds of it in all, since the call began). A bot that never speaks that
        long does not hold the caller more than MAX_WAIT_S."""
        due = [at for at in self._after_bot if start <= at < end]
        if not due:
            return False
        at = due[0]
        since = self._waiting.setdefault(at, self._clock.now())
        if self._heard() < self._after_bot[at] and self._clock.now() - since < MAX_WAIT_S:
            return True
        del self._after_bot[at]
        self.waited[at] = self._clock.now() - since
        return self._waits(start, end)

    def as_sent(self) -> np.ndarray:
        """The caller's audio as it went down the line: with the silence of each wait."""
        parts, last = [], 0
        for at, seconds in sorted(self.waited.items()):
            parts += [self._audio[last:at], np.zeros(int(seconds * self._rate), np.int16)]
            last = at
        return np.concatenate([*parts, self._audio[last:]])


class WavCallOutput(BaseOutputTransport):
    def __init__(self, clock: CallClock, params: TransportParams, realtime: bool = True):
        super().__init__(params)
        self._clock, self._realtime = clock, realtime
        self._playhead = 0.0  # call time when the audio written so far ends
        self.chunks: list[tuple[float, bytes]] = []  # (call time it started playing, pcm16)

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        at = max(self._clock.now(), self._playhead)
        self.chunks.append((at, frame.audio))
        self._playhead = at + audio_seconds(frame)
        if self._realtime:  # like a device: return once this chunk is (about to be) played
            await asyncio.sleep(max(0.0, at - self._clock.now()))
        return True

    def heard(self) -> float:
        """Seconds of the bot's audio played by now."""
        now = self._clock.now()
        return sum(min(len(pcm) / (2 * self.sample_rate), max(0.0, now - at))
                   for at, pcm in self.chunks)

    def timeline(self, seconds: float) -> np.ndarray:
        """The bot's audio as int16 on the call's timeline, `seconds` long."""
        rate = self.sample_rate
        out = np.zeros(int(seconds * rate) + 1, dtype=np.int16)
        for at, pcm in self.chunks:
            samples = np.frombuffer(pcm, dtype=np.int16)
            start = int(at * rate)
            end = min(len(out), start + len(samples))
            if start < end:
                out[start:end] = samples[: end - start]
        return out


class WavCallTransport(BaseTransport):
    """A simulated phone line for `voiceagent call`; `after_bot` as `WavCallInput` has it."""

    def __init__(
        self, audio: np.ndarray, sample_rate: int, out_sample_rate: int, realtime: bool = True,
        after_bot: dict[int, float] | None = None,
    ):
        super().__init__()
        self.clock = CallClock()
        params = TransportParams(
            audio_in_enabled=True,
            audio_in_sample_rate=sample_rate,
            audio_out_enabled=True,
            audio_out_sample_rate=out_sample_rate,
        )
        self._output = WavCallOutput(self.clock, params, realtime)
        self._input = WavCallInput(audio, sample_rate, self.clock, params, realtime, after_bot,
                                   self._output.heard)

    def input(self) -> WavCallInput:
        return self._input

    def output(self) -> WavCallOutput:
        return self._output

