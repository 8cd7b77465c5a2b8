"""The bot does not start to talk while the caller's voice is rising.

A turn ends on a pause; a caller who only stopped to think goes on a few hundred ms later, and a
reply ready by then would start over their first word. The VAD confirms speech `start_secs`
after it begins (and a barge-in cuts the reply only then), so the caller would hear the bot's
first word ("The") before it stopped. People wait when the other starts again: here the bot's
audio is held from the caller's first voiced window (UserVoiceRisingFrame) while the bot is
silent, until the voice falls quiet unconfirmed (the held audio then plays) or is confirmed and
interrupts the reply (the held audio is dropped, as pipecat drops queued audio). Audio that is
already playing goes on: over a speaking bot, speech is a barge-in or a backchannel, as before.
"""

from __future__ import annotations

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

_VOICE_ON = (UserVoiceRisingFrame, UserSpeechResumedFrame)
_VOICE_OFF = (UserVoiceFellFrame, UserSpeechPausedFrame, VADUserStoppedSpeakingFrame)


class OnsetHold(FrameProcessor):
    """Frames in: the bot's output on its way to the transport, and the VAD's frames. Frames
    out: the same, with the bot's output held from an audio frame that would start its speech
    while the caller's voice is on, until the voice is off (released in order) or an
    interruption (dropped, uninterruptible frames excepted, as pipecat's queues keep them)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, **kwargs):
        super().__init__(**kwargs)
        self._clock = clock
        self._voice = False
        self._playing_until = 0.0  # when the audio let through so far ends playing
        self._held: list[Frame] = []
        self.holds = 0  # times the bot's start was held (for tests and logs)

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
            self._held.clear()
        elif isinstance(frame, EndFrame):
            await self._release()  # the call is ending: what was said goes out first
        elif not isinstance(frame, SystemFrame) and (self._held or self._starts_over(frame)):
            if not self._held:
                self.holds += 1
                logger.debug(f"{self}: the caller's voice is rising: the bot's speech waits")
            self._held.append(frame)
            return
        await self._pass(frame)

    def _starts_over(self, frame: Frame) -> bool:
        """Whether `frame` would start the bot's speech while the caller's voice is on."""
        return (self._voice and isinstance(frame, OutputAudioRawFrame)
                and self._clock() >= self._playing_until)

    async def _pass(self, frame: Frame) -> None:
        if isinstance(frame, OutputAudioRawFrame):
            now = self._clock()
            self._playing_until = max(now, self._playing_until) + audio_seconds(frame)
        await self.push_frame(frame)

    async def _release(self) -> None:
        held, self._held = self._held, []
        for frame in held:
            await self._pass(frame)

    async def _drop(self) -> None:
        held, self._held = self._held, []
        self._playing_until = 0.0  # the transport drops what it queued: the bot is silent
        for frame in held:
            if not frame.interruptible:
                await self.push_frame(frame)
