"""Call recording, opt-in (`store.audio`): the caller on the left channel and the bot on the right,
on the call's one timeline, one WAV per call in the recordings folder beside the turn store. The
dashboard serves it behind its token; the store's retention deletes it with the call's turns.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import numpy as np
from loguru import logger
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InputAudioRawFrame,
    OutputAudioRawFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

from audio.wav import resample, write_wav
from voiceagent.config import Config

_CALL_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what a file name may be made of


def recordings_dir(cfg: Config) -> Path:
    return Path(cfg.store.audio_dir or Path(cfg.paths.runs_dir) / "recordings").expanduser()


def recording_path(folder: Path, call_id: str) -> Path | None:
    """The call's WAV in `folder`; None for an id that cannot name a file there."""
    return folder / f"{call_id}.wav" if _CALL_ID.match(call_id) else None


class CallRecorder(FrameProcessor):
    """After the output transport: the caller's audio as it came in (a line delivers it without
    gaps, so it lies on the timeline by count from the call's start) and the bot's where the
    transport played it (it passes here as it starts to play), written when the call ends.

    pipecat's AudioBufferProcessor lines the two up by when each frame reaches it; the caller's
    frames reach the end of the pipeline late (the VAD and the STT hold them briefly), which put
    the bot's audio ~80 ms early on its timeline. For the same reason the timeline's 0 is taken at
    the front (`front()`, right after the input transport), when the caller's first frame enters:
    the StartFrame reaches this end after every processor's start, 40 ms later on a loaded
    machine, which put the bot's audio that much early.
    """

    def __init__(self, path: Path | None, call_id: str):
        super().__init__()
        self._path, self._call_id = path, call_id
        self._t0: float | None = None
        self._started_at = 0.0  # the wall clock at the timeline's 0, as turn records keep time
        self._caller: list[tuple[bytes, int]] = []  # (pcm, rate), in order
        self._bot: list[tuple[float, bytes, int]] = []  # (seconds from the start, pcm, rate)

    def front(self) -> FrameProcessor:
        """The processor that starts the timeline; it goes right after the input transport."""
        return _TimelineStart(self)

    def start_timeline(self) -> None:
        if self._t0 is None:
            self._t0, self._started_at = time.monotonic(), time.time()

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if self._t0 is not None and isinstance(frame, InputAudioRawFrame):
            self._caller.append((frame.audio, frame.sample_rate))
        elif self._t0 is not None and isinstance(frame, OutputAudioRawFrame):
            self._bot.append((time.monotonic() - self._t0, frame.audio, frame.sample_rate))
        if isinstance(frame, (EndFrame, CancelFrame)):
            await self._save()
        await self.push_frame(frame, direction)

    async def _save(self) -> None:
        caller, bot, self._caller, self._bot = self._caller, self._bot, [], []
        if self._path is None or not (caller or bot):
            return
        try:
            await asyncio.to_thread(_write, self._path, _stereo(caller, bot), self._started_at)
        except OSError as exc:  # a full disk costs the recording, never the call
            logger.error(f"call {self._call_id}: recording not written: {exc}")


class _TimelineStart(FrameProcessor):
    """Starts its recorder's timeline when the caller's first frame passes."""

    def __init__(self, recorder: CallRecorder):
        super().__init__()
        self._recorder = recorder

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, InputAudioRawFrame):
            self._recorder.start_timeline()
        await self.push_frame(frame, direction)


def call_recorder(folder: Path, call_id: str) -> CallRecorder:
    return CallRecorder(recording_path(folder, call_id), call_id)


def _stereo(caller: list[tuple[bytes, int]], bot: list[tuple[float, bytes, int]]):
    """Both tracks at the bot's rate (the caller's where the bot never spoke): (samples, rate).
    The caller's track is resampled once, whole: chunk by chunk, the filter's edges would click
    every 20 ms."""
    rate = bot[0][2] if bot else caller[0][1]
    caller_rate = caller[0][1] if caller else rate
    left = resample(np.concatenate([_at(pcm, r, caller_rate) for pcm, r in caller])
                    if caller else np.zeros(0, np.int16), caller_rate, rate)
    chunks = [(int(at * rate), _at(pcm, r, rate)) for at, pcm, r in bot]
    n = max([len(left), *(start + len(x) for start, x in chunks)])
    stereo = np.zeros((n, 2), dtype=np.int16)
    stereo[: len(left), 0] = left
    for start, x in chunks:
        stereo[start : start + len(x), 1] = x
    return stereo, rate


def _at(pcm: bytes, rate: int, to_rate: int) -> np.ndarray:
    """A chunk as int16 at its track's rate (a no-op but for a chunk at another rate)."""
    return resample(np.frombuffer(pcm, dtype=np.int16), rate, to_rate)


def _write(path: Path, audio: tuple[np.ndarray, int], started_at: float) -> None:
    stereo, sample_rate = audio
    path.parent.mkdir(parents=True, exist_ok=True)
    started_path(path).write_text(json.dumps({"started_at": started_at}))
    partial = path.with_suffix(".partial.wav")
    write_wav(partial, stereo, sample_rate)
    partial.replace(path)  # a reader never sees half a file


def started_path(recording: Path) -> Path:
    """Beside a recording: the wall clock (epoch seconds) at its first sample."""
    return recording.with_suffix(".json")


def started_at(recording: Path) -> float | None:
    try:
        return float(json.loads(started_path(recording).read_text())["started_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prune_recordings(folder: Path, older_than: float) -> int:
    """Delete the recordings last written before `older_than` (epoch seconds); how many."""
    gone = 0
    for path in [*folder.glob("*.wav"), *folder.glob("*.json")] if folder.is_dir() else ():
        try:
            if path.stat().st_mtime < older_than:
                path.unlink()
                gone += 1
        except OSError as exc:  # gone already (another process's retention), or not ours to
            logger.debug(f"recording {path.name} kept: {exc}")  # delete: the next hour retries
    return gone
