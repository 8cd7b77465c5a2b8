"""Streaming Piper TTS for pipecat that starts speaking at the first clause, not the first sentence.

Built on pipecat's TTSService, which already does what we need around synthesis: the output rate
is the transport's (`audio_out_sample_rate` of the StartFrame), audio is queued per context, and an
InterruptionFrame cancels synthesis and drops the queued audio. Like pipecat's PiperTTSService it
runs Piper in-process, in a worker thread; unlike it, every call shares one loaded voice (loading
takes about 0.5 s and 60 MB, too much per call and too slow for the event loop). What changes:

- the text aggregator: pipecat's SimpleTextAggregator waits for the end of a sentence; ours
  releases each clause (audio.text.ClauseSplitter), so the first audio comes sooner;
- run_tts synthesises text clause by clause too, for text that arrives whole (TTSSpeakFrame),
  passes our length scale to Piper, and resamples each clause in one piece (see _synthesize);
- a prepared reply (PreparedResponseStartFrame) is synthesised like any other, and its audio is
  held after us (held_reply.py); when it is withdrawn (EagerEndOfTurnCancelFrame) we drop it as
  an interruption would: its queued text, its clause in progress and its audio;
- a reply is an opening (`speech_worker.Openings`) from its start to its first chunk's audio, so
  that the process's speech workers hold their background jobs meanwhile;
- a reply's later phrases are synthesised as its playback needs them (`tts.lead_s`,
  `playback_lead.py`), not all at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path

from loguru import logger
from pipecat.frames.frames import (
    CancelFrame,
    EagerEndOfTurnCancelFrame,
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    TTSSpeakFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TTSService
from pipecat.utils.text.base_text_aggregator import Aggregation, BaseTextAggregator, TextType
from pipecat.utils.tracing.service_decorators import traced_tts
from piper import SynthesisConfig

from audio.config import TTSConfig
from audio.loaders import load_piper
from audio.text import ClauseSplitter, split_clauses
from audio.wav import resample
from voiceagent.models import resolve
from voiceagent.pipeline.frames import PreparedResponseStartFrame
from voiceagent.pipeline.playback_lead import PlaybackLead
from voiceagent.pipeline.speech_worker import BACKGROUND, CRITICAL, Openings, SpeechWorker, run_on

STOP_FRAME_TIMEOUT_S = 3.0  # pipecat's: a reply's audio context ends after this long without any


class ClauseTextAggregator(BaseTextAggregator):
    """pipecat text aggregator that yields clauses. Aggregations are typed SENTENCE: to pipecat a
    clause is a unit to speak, like a sentence."""

    def __init__(self, *, min_chars: int = 6, first_phrase_words: int = 0,
                 language: str | None = None):
        super().__init__(aggregation_type=TextType.SENTENCE, language=language)
        self._splitter = ClauseSplitter(min_chars, first_phrase_words)

    @property
    def text(self) -> Aggregation:
        return Aggregation(text=self._splitter.pending.strip(" "), type=TextType.SENTENCE)

    async def aggregate(self, text: str) -> AsyncIterator[Aggregation]:
        for clause in self._splitter.push(text):
            yield Aggregation(text=clause, type=TextType.SENTENCE)

    async def flush(self) -> Aggregation | None:
        rest = self._splitter.flush()
        return Aggregation(text=rest, type=TextType.SENTENCE) if rest else None

    async def handle_interruption(self):
        self._splitter.reset()

    async def reset(self):
        self._splitter.reset()


class ClausePiperTTSService(TTSService):
    """Frames in: LLMFullResponseStartFrame, LLMTextFrame..., LLMFullResponseEndFrame, or
    TTSSpeakFrame; InterruptionFrame; EagerEndOfTurnCancelFrame, UserStoppedSpeakingFrame.
    Frames out: TTSStartedFrame, TTSAudioRawFrame (at the output rate) per clause, TTSTextFrame,
    TTSStoppedFrame; on interruption, or the withdrawal of a prepared reply, queued audio is
    dropped and nothing more of that reply is synthesised.
    """

    def __init__(self, *, voice, voice_name: str, cfg: TTSConfig,
                 worker: SpeechWorker | None = None,
                 hold_engine: Callable[[threading.Event, float], None] | None = None,
                 openings: Openings | None = None, **kwargs):
        super().__init__(
            push_start_frame=True,
            push_stop_frames=True,
            stop_frame_timeout_s=STOP_FRAME_TIMEOUT_S,
            settings=TTSSettings(model=None, voice=voice_name, language=None),
            **kwargs,
        )
        self._voice = voice  # a loaded piper.PiperVoice, shared by every call
        self._worker = worker  # the process's TTS worker (`speech_worker`), shared by every call
        self._first_phrase = True  # the next clause opens a reply: it goes before later ones
        self._reply = False  # ... a reply the engine decodes (not a TTSSpeakFrame)
        # Holds this call's engine requests while its first phrase is synthesised (until the
        # event is set, at most `first_phrase_hold_s`); None: no in-process engine, or off.
        self._hold_engine = hold_engine if cfg.first_phrase_hold_s > 0 else None
        self._hold_s = cfg.first_phrase_hold_s
        self._openings = openings  # this call's reply, from its start to its first audio
        # The reply's audio ahead of its playback; a wait and the synthesis after it stay well
        # inside the quiet spell after which pipecat would end the reply's audio context.
        self._lead = PlaybackLead(cfg.lead_s, max_wait_s=STOP_FRAME_TIMEOUT_S / 2)
        self._min_clause_chars = cfg.min_clause_chars
        self._first_phrase_words = cfg.first_phrase_words
        self._syn_config = SynthesisConfig(length_scale=cfg.length_scale)
        self._text_aggregator = ClauseTextAggregator(
            min_chars=cfg.min_clause_chars, first_phrase_words=cfg.first_phrase_words,
            language=self._text_aggregator.language,
        )
        self._preparing = False  # synthesising a reply whose turn is not confirmed yet
        # The caller's turn ended since it last started: a prepared reply that reaches us after
        # its commit (the commit, a system frame, can overtake it) is committed already.
        self._turn_ended = False

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        if isinstance(frame, LLMFullResponseStartFrame | TTSSpeakFrame):
            self._first_phrase = True
            self._lead.start()
            # A spoken template or filler (TTSSpeakFrame) has no reply decoding beside it.
            self._reply = isinstance(frame, LLMFullResponseStartFrame)
        if isinstance(frame, LLMFullResponseStartFrame):
            prepared = isinstance(frame, PreparedResponseStartFrame)
            self._preparing = prepared and not self._turn_ended
            self._opening(not frame.skip_tts)
        elif isinstance(frame, UserStartedSpeakingFrame):
            self._turn_ended = False
        elif isinstance(frame, UserStoppedSpeakingFrame):
            self._preparing, self._turn_ended = False, True  # the reply is committed
        await super().process_frame(frame, direction)
        # Its text is synthesised by the end of the reply (pipecat awaits `run_tts` as it goes):
        # no first audio comes of it after that, an interruption, or the call's end.
        if isinstance(frame, LLMFullResponseEndFrame | InterruptionFrame | EndFrame | CancelFrame):
            self._opening(False)
        if isinstance(frame, EagerEndOfTurnCancelFrame) and self._preparing:
            self._opening(False)
            self._preparing = False
            await self._start_interruption()  # its text still queued here goes too
            await self._handle_interruption(InterruptionFrame(), direction)

    async def cleanup(self):
        self._opening(False)  # whatever ended the call, its reply holds no one
        await super().cleanup()

    def can_generate_metrics(self) -> bool:
        return True

    @traced_tts
    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame, None]:
        try:
            await self.start_tts_usage_metrics(text)
            async for frame in self._stream_audio_frames_from_iterator(
                self._synthesize(
                    split_clauses(text, self._min_clause_chars, self._first_phrase_words)),
                in_sample_rate=self.sample_rate,  # already resampled, see _synthesize
                context_id=context_id,
            ):
                await self.stop_ttfb_metrics()
                yield frame
        except Exception as e:
            logger.error(f"{self} exception: {e}")
            yield ErrorFrame(error=f"Piper synthesis failed: {e}")
        finally:
            await self.stop_ttfb_metrics()

    async def _synthesize(self, clauses: list[str]) -> AsyncIterator[bytes]:
        """Piper audio for each clause in turn at the output rate, computed in a worker thread.

        Each Piper chunk is a whole clause, so it is resampled in one piece. pipecat's stream
        resampler would keep its filter delay (36 ms at 16 kHz, 70 ms at 8 kHz) back at the end
        of each chunk and clear it after 0.2 s idle: the end of every clause would be lost.
        """
        rate = self._voice.config.sample_rate
        for clause in clauses:
            chunks = self._voice.synthesize(clause, syn_config=self._syn_config)
            while (chunk := await self._next_chunk(chunks)) is not None:
                self._lead.synthesised(len(chunk.audio_int16_array) / rate, time.monotonic())
                yield resample(chunk.audio_int16_array, rate, self.sample_rate).tobytes()

    def _opening(self, on: bool) -> None:
        if self._openings is not None:
            (self._openings.open if on else self._openings.close)(self)

    async def _next_chunk(self, chunks):
        """Piper's next chunk on the process's TTS worker (a reply's first phrase before other
        calls' later ones)."""
        first, self._first_phrase = self._first_phrase, False
        wait_s = 0.0 if first else self._lead.wait_s(time.monotonic())
        if wait_s > 0:  # the caller hears what is synthesised already meanwhile
            await asyncio.sleep(wait_s)
        try:
            return await self._chunk_on_worker(chunks, first)
        finally:
            if first:
                self._opening(False)  # its first audio is out

    async def _chunk_on_worker(self, chunks, first: bool):
        if not (first and self._reply) or self._hold_engine is None:
            return await run_on(self._worker, next, chunks, None,
                                priority=CRITICAL if first else BACKGROUND)
        hold, max_s = self._hold_engine, self._hold_s

        def held():  # from when Piper starts, not while the job waits behind other calls'
            done = threading.Event()
            hold(done, max_s)
            try:
                return next(chunks, None)
            finally:
                done.set()

        return await run_on(self._worker, held, priority=CRITICAL)


def load_tts_voice(cfg: TTSConfig):
    """The PiperVoice the registry names; one per process, shared by every call (its ONNX
    session is safe to call from several threads)."""
    return load_piper(resolve(cfg.voice, "tts").location, use_cuda=cfg.use_cuda,
                      cpu_threads=cfg.cpu_threads, spin=cfg.spin)


def make_tts(cfg: TTSConfig, voice, worker: SpeechWorker | None = None,
             hold_engine: Callable[[threading.Event, float], None] | None = None,
             openings: Openings | None = None) -> ClausePiperTTSService:
    """One call's TTS service over the process's `voice` (`load_tts_voice`) and TTS `worker`;
    its output rate follows the transport's. `openings`: the process's replies on their way to
    their first audio, this call's among them."""
    location = resolve(cfg.voice, "tts").location
    return ClausePiperTTSService(
        voice=voice, voice_name=Path(location).name.removesuffix(".onnx"), cfg=cfg,
        worker=worker, hold_engine=hold_engine, openings=openings)
