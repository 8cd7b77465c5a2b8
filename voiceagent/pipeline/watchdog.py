"""Ends a call that has gone quiet or run too long.

A live call always sends audio (Twilio streams 20 ms of μ-law even in silence; a browser sends its
microphone track), so no input at all for `idle_s` means the peer is gone without saying so. A
call longer than `max_s` is ended whatever it does: nothing holds a slot for ever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pipecat.frames.frames import CancelFrame, EndFrame, Frame, InputAudioRawFrame, StartFrame
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor


class CallWatchdog(FrameProcessor):
    """Frames in and out: everything, unchanged. Calls `on_end(reason)` once, when no input audio
    has passed for `idle_s` seconds, or `max_s` seconds after the StartFrame. `on_end` must not
    block: it typically schedules the end of the call, which cancels this processor's own task."""

    def __init__(self, idle_s: float, max_s: float, on_end: Callable[[str], None], **kwargs):
        super().__init__(**kwargs)
        self._idle_s = idle_s
        self._max_s = max_s
        self._on_end = on_end
        self._started = self._last = time.monotonic()
        self._task: asyncio.Task | None = None

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, InputAudioRawFrame):
            self._last = time.monotonic()
        elif isinstance(frame, StartFrame):
            self._started = self._last = time.monotonic()
            self._task = self.create_task(self._watch())
        elif isinstance(frame, (EndFrame, CancelFrame)) and self._task is not None:
            await self.cancel_task(self._task)
            self._task = None
        await self.push_frame(frame, direction)

    async def _watch(self):
        while True:
            now = time.monotonic()
            idle_left = self._idle_s - (now - self._last)
            call_left = self._max_s - (now - self._started)
            if idle_left <= 0 or call_left <= 0:
                break
            await asyncio.sleep(min(1.0, idle_left, call_left))
        self._task = None
        if call_left <= 0:
            self._on_end(f"call length limit: {self._max_s:g} s")
        else:
            self._on_end(f"idle timeout: no audio for {self._idle_s:g} s")
