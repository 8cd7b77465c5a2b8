"""The speech models every call shares, loaded once per process: Whisper (ASR), the Piper voice
(TTS), Silero (VAD) and, when the turn ends on `smart_turn`, Smart Turn v3.

Each is safe to call from several threads (CTranslate2, onnxruntime); what is a call's own (the
VAD's recurrent state, Smart Turn's audio, the STT's transcript) lives in its services.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
from pipecat.audio.vad.silero import SileroOnnxModel

from audio.asr import SAMPLE_RATE, StreamingTranscriber
from audio.synth import synthesize
from llm_engine.threads import Load
from voiceagent.config import Config
from voiceagent.pipeline.speech_worker import Openings, SpeechWorker
from voiceagent.pipeline.stt import asr_threads, load_asr_model
from voiceagent.pipeline.tts import load_tts_voice
from voiceagent.pipeline.turns import load_smart_turn_session
from voiceagent.pipeline.vad import load_vad_model

# What the TTS synthesises while the engine measures its threads beside it (a reply's phrase),
# and what Whisper transcribes while it measures them beside speech recognition.
LOAD_PHRASE = "Your order shipped on Monday, and it should arrive by Thursday afternoon."
SETTINGS = ("asr.model", "asr.device", "asr.compute_type", "asr.cpu_threads", "tts.voice",
            "tts.use_cuda", "tts.cpu_threads", "tts.spin", "vad.model")


def speech_settings(cfg: Config) -> dict[str, object]:
    """The config keys that decide which speech models it needs (Smart Turn aside)."""
    out = {}
    for key in SETTINGS:
        section, name = key.split(".")
        out[key] = getattr(getattr(cfg, section), name)
    return out


@dataclass(frozen=True, eq=False)
class SpeechModels:
    whisper: Any  # faster_whisper.WhisperModel
    voice: Any  # piper.PiperVoice
    vad: SileroOnnxModel
    smart_turn: Any | None  # onnxruntime.InferenceSession; None unless turn.stop needs it
    settings: dict[str, object]  # speech_settings of the config they were loaded for
    # One thread each for Whisper and Piper, serving every call, urgent work first; their
    # background jobs wait while a reply opens (`server.opening_hold_ms`).
    asr_worker: SpeechWorker
    tts_worker: SpeechWorker
    openings: Openings | None  # None: the hold is off
    asr_threads: int = 0  # Whisper's CPU threads (`asr.cpu_threads` resolved; 0: its default)

    @classmethod
    def load(cls, cfg: Config, progress: Callable[[str], None] = print,
             engine_threads: int | None = None, voice: Any | None = None) -> SpeechModels:
        """`engine_threads`: the in-process engine's forward threads on this CPU (None: none),
        which `asr.cpu_threads: auto` leaves the cores of; `voice`: the Piper voice, if loaded
        already (`load_voice`)."""
        voice = voice if voice is not None else load_voice(cfg, progress)
        threads = asr_threads(cfg.asr, engine_threads)
        progress(f"loading ASR {cfg.asr.model} on {threads or 'default'} CPU threads ...")
        whisper = load_asr_model(cfg.asr, threads)
        vad = load_vad_model(cfg.vad)
        smart_turn = load_smart_turn_session() if cfg.turn.stop == "smart_turn" else None
        hold_s = cfg.server.opening_hold_ms / 1000
        openings = Openings() if hold_s > 0 else None
        return cls(whisper, voice, vad, smart_turn, speech_settings(cfg),
                   SpeechWorker("asr-worker", openings, hold_s),
                   SpeechWorker("tts-worker", openings, hold_s), openings, threads)

    def busy(self) -> bool:
        """Whether Whisper or Piper is running a job now (safe from any thread)."""
        return self.asr_worker.busy() or self.tts_worker.busy()

    def close(self) -> None:
        self.asr_worker.close()
        self.tts_worker.close()

    def serves(self, cfg: Config) -> str | None:
        """None if a call with `cfg` can run on these models; otherwise why not (a call must
        not silently run on a model other than the one its config names)."""
        wanted = speech_settings(cfg)
        differ = [f"{k}={wanted[k]!r} (loaded: {self.settings[k]!r})" for k in SETTINGS
                  if wanted[k] != self.settings[k]]
        if differ:
            return f"the speech models were loaded for other settings: {', '.join(differ)}"
        if cfg.turn.stop == "smart_turn" and self.smart_turn is None:
            return "turn.stop is smart_turn, but no Smart Turn model is loaded"
        return None


def load_voice(cfg: Config, progress: Callable[[str], None] = print):
    progress(f"loading TTS voice {cfg.tts.voice} ...")
    return load_tts_voice(cfg.tts)


def decoding_load(cfg: Config, voice) -> Load:
    """What runs beside the engine's decoding in every reply, for the engine to measure its
    threads beside (`engine.threads: auto`): Piper (`voice`) synthesising a phrase, then resting
    as long, so busy about half the time, as while a reply is spoken."""
    threads = cfg.tts.cpu_threads or "default"
    # how its threads wait between ops is part of the name: a choice cached beside spinning
    # threads is not one beside sleeping ones
    waits = "spinning" if cfg.tts.spin else "sleeping"
    return Load(f"TTS {cfg.tts.voice} on {threads} threads {waits} between ops, half the time",
                lambda: _synthesising(voice))


def recognition_load(cfg: Config, speech: SpeechModels) -> Load:
    """Whisper transcribing a caller's sentence over and over, as at a caller's pause while the
    reply is prepared: the engine's thread count beside it (`EngineWorker.share_cores`)."""
    audio: list[np.ndarray] = []  # synthesised when first measured beside, not at every start

    def transcribe() -> None:
        if not audio:
            audio.append(synthesize(speech.voice, LOAD_PHRASE, SAMPLE_RATE))
        transcriber = StreamingTranscriber(speech.whisper, cfg.asr)
        transcriber.feed(audio[0])
        transcriber.interim(settle=True)

    asr = cfg.asr
    return Load(f"ASR {asr.model} ({asr.device}, {asr.compute_type}, {asr.window} window) on "
                f"{speech.asr_threads or 'default'} threads, transcribing",
                lambda: _looping(transcribe, "ASR", rest=False))


def _synthesising(voice) -> AbstractContextManager:
    def synthesise() -> None:
        for _ in voice.synthesize(LOAD_PHRASE):
            pass
    return _looping(synthesise, "TTS", rest=True)


@contextlib.contextmanager
def _looping(work: Callable[[], None], what: str, rest: bool) -> Iterator[None]:
    """`work()` over and over on a thread of its own (resting as long as each took when
    `rest`). Raises what it raised: a choice measured beside no load must not be kept."""
    stop = threading.Event()
    failed: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.is_set():
                start = time.perf_counter()
                work()
                if rest:
                    stop.wait(time.perf_counter() - start)
        except Exception as exc:
            failed.append(exc)

    thread = threading.Thread(target=loop, name=f"{what.lower()}-load", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    if failed:
        raise RuntimeError(f"the {what} failed while the engine measured its threads beside "
                           f"it: {failed[0]}") from failed[0]
