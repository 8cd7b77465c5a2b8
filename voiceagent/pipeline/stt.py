"""Streaming faster-whisper STT for pipecat: interims while the caller speaks, a fast final.

pipecat's WhisperSTTService is a SegmentedSTTService: it transcribes the whole segment only after
the VAD stop, so the final always costs one full model run after the turn ends. This service keeps
the utterance in an audio.asr.StreamingTranscriber, re-transcribes it at a cadence while the
caller speaks (InterimTranscriptionFrame), and at the VAD stop reuses the last interim when it
already covered the end of speech. The model always runs in a worker thread.

Early response preparation: at the caller's first silent VAD window (UserSpeechPausedFrame) it
transcribes the utterance so far and reports it as pipecat's eager end of turn
(EagerTranscriptionFrame, through pipecat's EagerEndOfTurnSTTServiceMixin), so a reply can be
prepared while the VAD's hangover runs. Speech again before the VAD stop withdraws it
(EagerEndOfTurnCancelFrame). That transcript heard everything up to the pause, so at the VAD stop
it is the final as it stands: the committed transcript equals the eager one unless the caller
spoke again.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncGenerator

import numpy as np
from loguru import logger
from pipecat.audio.utils import create_stream_resampler
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InterimTranscriptionFrame,
    MetricsFrame,
    TranscriptionFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.settings import STTSettings
from pipecat.services.stt_service import STTService
from pipecat.transcriptions.language import Language
from pipecat.turns.eager_end_of_turn_mixin import EagerEndOfTurnSTTServiceMixin
from pipecat.turns.user_stop import NormalizedMatch
from pipecat.utils.time import time_now_iso8601

from audio.asr import SAMPLE_RATE, StreamingTranscriber, Transcript
from audio.config import ASRConfig
from audio.loaders import load_whisper
from voiceagent.models import resolve
from voiceagent.pipeline.frames import (
    UserSpeechPausedFrame,
    UserSpeechResumedFrame,
    UserWordsSoFarFrame,
)
from voiceagent.pipeline.metrics import ASRFinalMetricsData
from voiceagent.pipeline.speech_worker import BACKGROUND, CRITICAL, SpeechWorker, run_on
from voiceagent.pipeline.turns import FINISHED, ending

# An interim that missed at most this much audio before the pause may stand in for the pause's
# own transcript while that runs: the pause comes a VAD window or two after the speech ends.
GUESS_MISSED_MS = 200


class StreamingWhisperSTTService(EagerEndOfTurnSTTServiceMixin, STTService):
    """Frames in: InputAudioRawFrame (any rate, resampled to 16 kHz), VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame, UserSpeechPausedFrame, UserSpeechResumedFrame. Frames out,
    besides everything passed through:

    - InterimTranscriptionFrame each `interim_every_ms` of new audio while the caller speaks; an
      interim that comes due while the previous one still runs is skipped, not queued;
    - with `prepare`: EagerTranscriptionFrame after a pause, EagerEndOfTurnCancelFrame when the
      caller speaks again before the VAD stop; after an interim, UserWordsSoFarFrame when the
      words two interims agree on have grown (the LLM prefills them);
    - after each VAD stop, TranscriptionFrame(finalized=True) and a MetricsFrame carrying
      ASRFinalMetricsData. The final waits for a running interim or pause transcript and no more.
    """

    def __init__(self, *, model, cfg: ASRConfig, prepare: bool = False,
                 worker: SpeechWorker | None = None, ttfs_p99_latency: float = 1.0, **kwargs):
        super().__init__(
            settings=STTSettings(model=cfg.model, language=cfg.language or None),
            ttfs_p99_latency=ttfs_p99_latency,
            enable_eager_end_of_turn=prepare,
            **kwargs,
        )
        self._model = model
        self._cfg = cfg
        self._worker = worker  # the process's ASR worker (`speech_worker`), shared by every call
        self._preroll_samples = cfg.preroll_ms * SAMPLE_RATE // 1000
        self._preroll = np.zeros(0, np.int16)  # the latest audio while nobody speaks
        self._utterance: StreamingTranscriber | None = None  # set between VAD start and stop
        self._interim_task: asyncio.Task | None = None
        self._interim_started = threading.Event()  # the last interim's model pass has begun
        self._final_task: asyncio.Task | None = None
        self._pause_task: asyncio.Task | None = None  # transcribes the utterance at a pause
        self._paused = False  # between a pause and the speech that resumes it (or the stop)
        self._pauses = 0  # counts pauses and resumes: a pause transcript belongs to one pause
        self._resumed_at = 0  # samples into the utterance where the caller last resumed
        self._words_so_far = ""  # the last UserWordsSoFarFrame of this utterance
        self._resampler = create_stream_resampler()

    def can_generate_metrics(self) -> bool:
        return True

    async def run_stt(self, audio: bytes) -> AsyncGenerator[Frame | None, None]:
        """Called by STTService for each audio frame: buffer it; start an interim when due."""
        if self.sample_rate != SAMPLE_RATE:
            audio = await self._resampler.resample(audio, self.sample_rate, SAMPLE_RATE)
        samples = np.frombuffer(audio, dtype=np.int16)
        if self._utterance is None:
            self._preroll = np.concatenate([self._preroll, samples])[-self._preroll_samples :]
        else:
            self._utterance.feed(samples)
            self._maybe_start_interim()
        yield None  # results are pushed by the interim and final tasks

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, UserSpeechPausedFrame):
            self._on_pause()
        elif isinstance(frame, UserSpeechResumedFrame):
            self._paused = False  # a pause transcript still running is now stale
            self._pauses += 1
            # An interim from before this resume heard none of what follows: no guess at the
            # next pause.
            self._resumed_at = self._utterance.samples if self._utterance else 0
            await self._cancel_eager_end_of_turn()

    def _on_pause(self) -> None:
        utterance = self._utterance
        if utterance is None or not self.eager_end_of_turn_enabled:
            return
        self._paused = True
        self._pauses += 1
        self._drop_queued_interim()
        running = [t for t in (self._interim_task, self._pause_task) if t is not None]
        self._pause_task = self.create_task(
            self._transcribe_pause(utterance, utterance.samples, running, self._pauses),
            name="asr_pause")

    async def _transcribe_pause(self, utterance: StreamingTranscriber, pause_at: int,
                                running: list[asyncio.Task], pause: int):
        """The utterance up to the pause, as an eager end of turn (unless the caller went on).

        A recent interim whose words end a sentence goes out first (`asr.pause_interim`): the
        reply is prepared on it while the pause's own transcript runs, and prepared again only
        if that hears other words.

        With `asr.digits_padded`, a cut run that holds digits owes the padded one
        (audio.whisper_window), which costs about three cut runs: the reply is prepared on the
        cut run's words meanwhile, and prepared again if the padded run hears otherwise (the
        turn end commits a prepared reply only when the final transcript matches it)."""
        try:
            for task in running:
                await task  # one model run at a time: two would share the same cores
            guess = ""
            result = utterance.last_interim
            if result is None or result.samples < pause_at:
                if self._stands_in(utterance, result, pause_at):
                    guess = result.text
                    await self._push_eager(utterance, pause, guess)
                result = await self._transcribe(utterance.interim, priority=CRITICAL)
            if result.owed:
                if not _same_words(guess, result.text):
                    await self._push_eager(utterance, pause, result.text)
                guess = result.text
                result = await self._transcribe(utterance.interim, True, priority=CRITICAL)
            if guess and _same_words(guess, result.text):
                return
        except Exception as e:
            await self.push_error(f"{self}: pause transcription failed: {e}", exception=e)
            return
        await self._push_eager(utterance, pause, result.text if result else "")

    def _stands_in(self, utterance: StreamingTranscriber, interim: Transcript | None,
                   pause_at: int) -> bool:
        """Whether an interim that missed the last of the audio may start the reply while the
        pause's own transcript runs (`asr.pause_interim`): one that heard the caller's speech
        since it last resumed, up to `GUESS_MISSED_MS` before the pause, and whose words end a
        sentence, as Whisper punctuates what it heard as finished."""
        return (self._cfg.pause_interim and interim is not None and interim.text.strip()
                and not interim.owed and interim.samples >= self._resumed_at
                and pause_at - interim.samples <= GUESS_MISSED_MS * SAMPLE_RATE // 1000
                and ending(interim.text) == FINISHED)

    async def _push_eager(self, utterance: StreamingTranscriber, pause: int, text: str):
        """An eager end of turn, if the pause it belongs to still stands."""
        if pause == self._pauses and utterance is self._utterance and text:
            await self._push_eager_end_of_turn(text, user_id=self._user_id,
                                               language=self._language())

    async def _handle_vad_user_started_speaking(self, frame: VADUserStartedSpeakingFrame):
        await super()._handle_vad_user_started_speaking(frame)
        if self._utterance is None:
            self._utterance = StreamingTranscriber(self._model, self._cfg)
            self._utterance.feed(self._preroll)  # the VAD confirms speech start_secs late
            self._words_so_far = ""
            self._resumed_at = 0
            self._preroll = np.zeros(0, np.int16)

    async def _handle_vad_user_stopped_speaking(self, frame: VADUserStoppedSpeakingFrame):
        await super()._handle_vad_user_stopped_speaking(frame)
        utterance, self._utterance = self._utterance, None
        self._paused = False
        # The final settles this utterance's eager transcript; a later utterance's is its own.
        self._clear_eager_end_of_turn()
        if utterance is None:
            return
        self._drop_queued_interim()
        # Speech ended stop_secs before the VAD said so: the hangover is silence.
        speech_end = max(0, utterance.samples - round(frame.stop_secs * SAMPLE_RATE))
        # The clock starts when the stop reaches us, not at frame.timestamp: a frame can be built
        # before it is sent (tests, replays), and what we measure is our own delay.
        self._final_task = self.create_task(
            self._finalize(utterance, speech_end, time.time(),
                           [t for t in (self._interim_task, self._pause_task) if t is not None],
                           self._final_task),
            name="asr_final",
        )

    def _maybe_start_interim(self):
        utterance = self._utterance
        if utterance is None or self._paused or not utterance.interim_due():
            return  # paused: the pause transcript is the one that matters
        if self._interim_task is not None and not self._interim_task.done():
            return  # skip: queueing interims would only delay the final
        self._interim_started = threading.Event()
        self._interim_task = self.create_task(self._run_interim(utterance, self._interim_started),
                                              name="asr_interim")

    def _drop_queued_interim(self) -> None:
        """An interim still queued behind other calls' work is withdrawn: the transcript at a
        pause or at the stop, which would wait for it, goes first instead (the worker drops a
        job whose caller stopped waiting). One already running is awaited: it may cover the
        end of speech."""
        task = self._interim_task
        if task is not None and not task.done() and not self._interim_started.is_set():
            task.cancel()
            self._interim_task = None

    async def _run_interim(self, utterance: StreamingTranscriber, started: threading.Event):
        def interim() -> Transcript:
            started.set()
            return utterance.interim()

        try:
            result = await self._transcribe(interim, priority=BACKGROUND)
        except Exception as e:
            await self.push_error(f"{self}: interim transcription failed: {e}", exception=e)
            return
        # Once the VAD has stopped, this result only serves the final: an interim pushed after
        # the stop would tell turn detection that more transcription is on the way.
        if result.text and utterance is self._utterance:
            await self.push_frame(
                InterimTranscriptionFrame(result.text, self._user_id, time_now_iso8601(),
                                          self._language())
            )
            agreed = utterance.agreed_text
            if self.eager_end_of_turn_enabled and len(agreed) > len(self._words_so_far):
                self._words_so_far = agreed
                await self.push_frame(UserWordsSoFarFrame(agreed))

    async def _finalize(
        self,
        utterance: StreamingTranscriber,
        speech_end: int,
        stopped_at: float,
        running: list[asyncio.Task],
        previous: asyncio.Task | None,
    ):
        try:
            if previous is not None:
                await previous  # finals go out in utterance order
            for task in running:
                await task  # they may cover the end of speech; never wait for more than these
            if utterance.covers(speech_end):
                result = utterance.final(speech_end)  # no model run
            else:
                result = await self._transcribe(utterance.final, speech_end, priority=CRITICAL)
        except Exception as e:
            await self.push_error(f"{self}: final transcription failed: {e}", exception=e)
            return
        await self._push_final(result, stopped_at)

    async def _push_final(self, result: Transcript, stopped_at: float):
        final_ms = (time.time() - stopped_at) * 1000
        logger.debug(
            f"{self}: final [{result.text}] {final_ms:.0f} ms after VAD stop "
            f"({'reused interim' if result.reused else f'model {result.model_ms:.0f} ms'})"
        )
        if result.text:
            await self.push_frame(
                TranscriptionFrame(result.text, self._user_id, time_now_iso8601(),
                                   self._language(), finalized=True)
            )
        metrics = ASRFinalMetricsData(
            processor=self.name, model=self._cfg.model, final_ms=final_ms,
            audio_ms=result.audio_ms, reused_interim=result.reused,
        )
        await self.push_frame(MetricsFrame(data=[metrics]))

    async def _transcribe(self, fn, *args, priority: int):
        """A Whisper pass on the process's ASR worker, urgent ones first."""
        return await run_on(self._worker, fn, *args, priority=priority)

    def _language(self) -> Language | None:
        try:
            return Language(self._settings.language)
        except (ValueError, TypeError):
            return None

    async def stop(self, frame: EndFrame):
        if self._final_task is not None:
            await self._final_task  # a caller who hangs up right after speaking still gets it
            self._final_task = None
        await self._cancel_tasks()
        await super().stop(frame)

    async def cancel(self, frame: CancelFrame):
        await self._cancel_tasks()
        await super().cancel(frame)

    async def _cancel_tasks(self):
        for task in (self._interim_task, self._pause_task, self._final_task):
            if task is not None and not task.done():
                await self.cancel_task(task)
        self._interim_task = self._pause_task = self._final_task = None


def _same_words(a: str, b: str) -> bool:
    """What turn detection's match sees (pipecat's NormalizedMatch): case and punctuation
    aside."""
    return NormalizedMatch().matches(a, b)


def load_asr_model(cfg: ASRConfig, threads: int | None = None):
    """The WhisperModel the registry names; one per process, shared by every call (CTranslate2
    models are safe to call from several threads). `threads`: its CPU threads (`asr_threads`;
    None: as `asr.cpu_threads` says without an engine on this CPU)."""
    return load_whisper(resolve(cfg.model, "asr").location, device=cfg.device,
                        compute_type=cfg.compute_type,
                        cpu_threads=asr_threads(cfg, None) if threads is None else threads)


def asr_threads(cfg: ASRConfig, engine_threads: int | None) -> int:
    """`asr.cpu_threads`, auto resolved: beside an engine whose forward runs on
    `engine_threads` of this CPU, the cores this process may use less those, at least one;
    without one (None), CTranslate2's default (0)."""
    if cfg.cpu_threads != "auto":
        return cfg.cpu_threads
    if engine_threads is None:
        return 0
    return max(1, len(os.sched_getaffinity(0)) - engine_threads)


def make_stt(cfg: ASRConfig, model, worker: SpeechWorker | None = None,
             prepare: bool = False) -> StreamingWhisperSTTService:
    """One call's STT service over the process's `model` (`load_asr_model`) and ASR `worker`.
    `prepare`: report an eager end of turn at each pause."""
    return StreamingWhisperSTTService(model=model, cfg=cfg, prepare=prepare, worker=worker)
