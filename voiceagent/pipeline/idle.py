"""Ends a call whose transport has gone quiet: a phone leg or browser that stopped sending.

A live call always sends audio (Twilio streams 20 ms of μ-law even in silence; a browser sends its
microphone track), so no input at all for `timeout_s` means the peer is gone without saying so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pipecat.frames.frames import CancelFrame, EndFrame, Frame, InputAudioRawFrame, StartFrame
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor


class IdleWatchdog(FrameProcessor):
    """Frames in and out: everything, unchanged. Calls `on_idle()` once when no input audio has
    passed for `timeout_s` seconds after the StartFrame. `on_idle` must not block: it typically
    schedules the end of the call, which cancels this processor's own task."""

    def __init__(self, timeout_s: float, on_idle: Callable[[], None], **kwargs):
        super().__init__(**kwargs)
        self._timeout_s = timeout_s
        self._on_idle = on_idle
        self._last = time.monotonic()
        self._task: asyncio.Task | None = None

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, InputAudioRawFrame):
            self._last = time.monotonic()
        elif isinstance(frame, StartFrame):
            self._last = time.monotonic()
            self._task = self.create_task(self._watch())
        elif isinstance(frame, (EndFrame, CancelFrame)) and self._task is not None:
            await self.cancel_task(self._task)
            self._task = None
        await self.push_frame(frame, direction)

    async def _watch(self):
        while (quiet := time.monotonic() - self._last) < self._timeout_s:
            await asyncio.sleep(min(1.0, self._timeout_s - quiet))
        self._task = None
        self._on_idle()
