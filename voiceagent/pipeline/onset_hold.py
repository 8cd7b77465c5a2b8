"""The bot does not start to talk while the caller's voice is rising.

A turn ends on a pause; a caller who only stopped to think goes on a few hundred ms later, and a
reply ready by then would start over their first word. The VAD confirms speech `start_secs`
after it begins (and a barge-in cuts the reply only then), so the caller would hear the bot's
first word ("The") before it stopped. People wait when the other starts again: here the bot's
audio is held from the caller's first voiced window (UserVoiceRisingFrame) while the bot is
silent, until the voice falls quiet unconfirmed (the held audio then plays) or is confirmed and
interrupts the reply (the held audio is dropped, as pipecat drops queued audio), or at most
`max_hold_s` (the VAD's start_secs and a margin: a voice still unresolved then is not the
caller's speech). Audio that is already playing goes on: over a speaking bot, speech is a
barge-in or a backchannel, as before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from loguru import logger
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InterruptionFrame,
    OutputAudioRawFrame,
    SystemFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

from voiceagent.pipeline.frames import (
    UserSpeechPausedFrame,
    UserSpeechResumedFrame,
    UserVoiceFellFrame,
    UserVoiceRisingFrame,
    audio_seconds,
)

HOLD_MARGIN_S = 0.5  # a hold lasts at most the VAD's start_secs and this
_VOICE_ON = (UserVoiceRisingFrame, UserSpeechResumedFrame, VADUserStartedSpeakingFrame)
_VOICE_OFF = (UserVoiceFellFrame, UserSpeechPausedFrame, VADUserStoppedSpeakingFrame)


class OnsetHold(FrameProcessor):
    """Frames in: the bot's output on its way to the transport, and the VAD's frames. Frames
    out: the same, with the bot's output held from an audio frame that would start its speech
    while the caller's voice is on, until the voice is off or `max_hold_s` has passed (released
    in order) or an interruption (dropped, uninterruptible frames excepted, as pipecat's queues
    keep them). The bound keeps a voice that never resolves (a TV, a muted line) from silencing
    the bot: speech that goes on interrupts long before it."""

    def __init__(self, max_hold_s: float, clock: Callable[[], float] = time.monotonic,
                 **kwargs):
        super().__init__(**kwargs)
        self._max_hold_s = max_hold_s
        self._clock = clock
        self._voice = False
        self._playing_until = 0.0  # when the audio let through so far ends playing
        self._held: list[Frame] = []
        self._timer: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # the bound's release and the frames keep their order

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if direction == FrameDirection.UPSTREAM:
            await self.push_frame(frame, direction)
            return
        if isinstance(frame, _VOICE_ON):
            self._voice = True
        elif isinstance(frame, _VOICE_OFF):
            self._voice = False
            await self._release()
        if isinstance(frame, InterruptionFrame):
            await self._drop()
        elif isinstance(frame, CancelFrame):
            await self._stop_timer()
            self._held.clear()
        elif isinstance(frame, EndFrame):
            await self._release()  # the call is ending: what was said goes out first
        elif not isinstance(frame, SystemFrame):
            async with self._lock:
                if self._held or self._starts_over(frame):
                    self._hold(frame)
                    return
        await self._pass(frame)

    async def cleanup(self):
        await self._stop_timer()
        await super().cleanup()

    def _starts_over(self, frame: Frame) -> bool:
        """Whether `frame` would start the bot's speech while the caller's voice is on."""
        return (self._voice and isinstance(frame, OutputAudioRawFrame)
                and self._clock() >= self._playing_until)

    def _hold(self, frame: Frame) -> None:
        if not self._held:
            logger.debug(f"{self}: the caller's voice is rising: the bot's speech waits")
            self._timer = self.create_task(self._bound(), f"{self}::bound")
        self._held.append(frame)

    async def _bound(self) -> None:
        await asyncio.sleep(self._max_hold_s)
        self._timer = None  # this task ends with the release
        logger.debug(f"{self}: the voice did not resolve in {self._max_hold_s} s: the bot speaks")
        await self._release()

    async def _stop_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and timer is not asyncio.current_task():
            await self.cancel_task(timer)

    async def _pass(self, frame: Frame) -> None:
        if isinstance(frame, OutputAudioRawFrame):
            now = self._clock()
            self._playing_until = max(now, self._playing_until) + audio_seconds(frame)
        await self.push_frame(frame)

    async def _release(self) -> None:
        await self._stop_timer()
        async with self._lock:
            held, self._held = self._held, []
            for frame in held:
                await self._pass(frame)

    async def _drop(self) -> None:
        await self._stop_timer()
        async with self._lock:
            held, self._held = self._held, []
            self._playing_until = 0.0  # the transport drops what it queued: the bot is silent
            for frame in held:
                if not frame.interruptible:
                    await self._pass(frame)
