"""Streaming transcription of one utterance with faster-whisper, reusing work at turn end.

Whisper is not a streaming model: it transcribes a whole window. The usual way to stream it
(Macháček et al., "Turning Whisper into Real-Time Transcription System", 2023) is to re-run it on
the growing audio. Here that gives the interim transcripts while the caller speaks, and it gives
the final for free when the last interim already heard everything up to the end of speech: the
VAD only reports the end after its hangover (`stop_secs` of silence), and an interim run during
that silence covered all the speech there is. Only when it did not is the model run again.

No pipecat here: the caller decides when to call `interim()` and `final()`, and runs them off its
event loop. `feed` may be called from another thread while `interim` runs: `interim` transcribes
a snapshot.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from audio.config import ASRConfig
from audio.whisper_window import WhisperRun, transcribe_padded, transcribe_speech

SAMPLE_RATE = 16000  # Whisper's input rate


@dataclass(frozen=True)
class Transcript:
    text: str
    samples: int  # how much of the utterance (from its start, at 16 kHz) the text covers
    model_ms: float  # time spent in the model for this result; 0 when reused
    reused: bool = False  # the final is an earlier interim, the model was not run again
    window: str = "padded"  # which Whisper window answered: "speech" (cut) or "padded" (30 s)
    fallback: str = ""  # why a cut run gave way to the padded one
    owed: str = ""  # an interim's kept cut run still owes the padded one (digits): not final

    @property
    def audio_ms(self) -> float:
        return self.samples * 1000 / SAMPLE_RATE


class StreamingTranscriber:
    """One utterance at a time: `feed` audio, `interim()` while speaking, `final()` at the end.

    `model` is a faster_whisper.WhisperModel; `cfg.window` says whether a run's encoder sees
    the speech (audio.whisper_window) or Whisper's 30 s window.
    """

    def __init__(self, model, cfg: ASRConfig):
        self.model = model
        self.cfg = cfg
        self.interim_every = cfg.interim_every_ms * SAMPLE_RATE // 1000  # in samples
        self.max_samples = int(cfg.max_utterance_s * SAMPLE_RATE)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget the utterance; the next `feed` starts a new one."""
        with self._lock:
            self._chunks: list[np.ndarray] = []
            self._samples = 0
            self.dropped = 0  # samples beyond max_utterance_s, not transcribed
            self._interim_mark = 0  # samples fed when the last interim took its snapshot
            self._last: Transcript | None = None
            self._agreed = ""  # the words the last two interims agree on

    def feed(self, samples: np.ndarray) -> None:
        """Append 16 kHz mono int16 audio to the utterance, up to `max_utterance_s`."""
        assert samples.ndim == 1 and samples.dtype == np.int16, (samples.shape, samples.dtype)
        with self._lock:
            room = self.max_samples - self._samples
            if len(samples) > room:
                self.dropped += len(samples) - max(room, 0)
                samples = samples[: max(room, 0)]
            if not len(samples):
                return
            self._chunks.append(samples)
            self._samples += len(samples)

    @property
    def samples(self) -> int:
        """Samples fed into this utterance so far."""
        return self._samples

    @property
    def last_interim(self) -> Transcript | None:
        return self._last

    def covers(self, speech_end_offset: int | None = None) -> bool:
        """Whether the last interim heard all audio up to `speech_end_offset` (None: all fed) and
        may stand as the final (it owes no padded run)."""
        end = self._samples if speech_end_offset is None else speech_end_offset
        last = self._last
        return last is not None and not last.owed and last.samples >= end

    def interim_due(self) -> bool:
        """At least `interim_every_ms` of new audio since the last interim started."""
        return self._samples - self._interim_mark >= self.interim_every

    def interim(self, settle: bool = False) -> Transcript:
        """Transcribe the utterance so far (blocking: run it off the event loop). `settle`: a
        transcript that may stand as the final (at a pause), not a hint while the caller
        speaks: a cut run that holds digits is then redone padded."""
        audio = self._snapshot(mark_interim=True)
        result = self._transcribe(audio, settle)
        with self._lock:
            if self._last is None or result.samples >= self._last.samples:
                if self._last is not None:
                    self._agreed = _common_words(self._last.text, result.text)
                self._last = result
        return result

    @property
    def agreed_text(self) -> str:
        """The leading words the last two interims agree on: what is unlikely to change (the
        local agreement policy of Macháček et al.)."""
        return self._agreed

    def final(self, speech_end_offset: int | None = None) -> Transcript:
        """The final transcript (blocking). `speech_end_offset`: samples into the utterance
        where speech ended (the VAD stop minus its hangover); None means all audio fed.

        Returns the last interim, unchanged and without running the model, when it covered all
        audio up to the end of speech; otherwise transcribes everything once.
        """
        last = self._last
        if last is not None and self.covers(speech_end_offset):
            return Transcript(last.text, last.samples, model_ms=0.0, reused=True,
                              window=last.window, fallback=last.fallback)
        return self._transcribe(self._snapshot(mark_interim=False), settle=True)

    def _snapshot(self, mark_interim: bool) -> np.ndarray:
        with self._lock:
            audio = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
            self._chunks = [audio]
            if mark_interim:
                self._interim_mark = len(audio)
        return audio

    def _transcribe(self, audio: np.ndarray, settle: bool) -> Transcript:
        t0 = time.perf_counter()
        run = WhisperRun("", self.cfg.window)
        if len(audio):
            samples = audio.astype(np.float32) / 32768.0
            language = self.cfg.language or None
            owed = self._last.owed if self._last is not None else ""
            if self.cfg.window == "speech" and not (settle and owed):
                run = transcribe_speech(self.model, samples, language, self.cfg.beam_size,
                                        self.cfg.window_margin_ms, self.cfg.window_min_ms,
                                        self.cfg.digits_padded, settle)
            else:
                # The padded window, or an interim already heard digits (`digits_padded`): a cut
                # run would only give way again.
                run = WhisperRun(transcribe_padded(self.model, samples, language,
                                                   self.cfg.beam_size), "padded", owed)
        return Transcript(run.text, len(audio), model_ms=(time.perf_counter() - t0) * 1000,
                          window=run.window, fallback=run.fallback, owed=run.owed)


def _common_words(a: str, b: str) -> str:
    """The longest common prefix of whole words (a word's trailing punctuation may differ)."""
    words = []
    for x, y in zip(a.split(), b.split(), strict=False):
        if x.rstrip(".,!?;:").lower() != y.rstrip(".,!?;:").lower():
            break
        words.append(y.rstrip(".,!?;:") if x != y else y)
    return " ".join(words)
