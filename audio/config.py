"""Typed configuration of the audio components, one dataclass each.

Plain dataclasses keep `audio` free of application dependencies; `__pydantic_config__` lets the
application's YAML loader validate them strictly without this package importing pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

STRICT = {"extra": "forbid", "validate_assignment": True}


@dataclass
class VADConfig:
    """Silero VAD turn detection."""

    __pydantic_config__ = STRICT

    model: str = "silero-vad"
    confidence: float = 0.7
    start_secs: float = 0.2
    stop_secs: float = 0.3  # the hangover: silence before the turn counts as ended (see README)
    min_volume: float = 0.6


@dataclass
class ASRConfig:
    """faster-whisper transcription, streamed while the caller speaks."""

    __pydantic_config__ = STRICT

    model: str = "whisper-tiny.en"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compute_type: str = "auto"  # CTranslate2 compute type; auto = int8 on CPU, float16 on CUDA
    language: str = "en"
    beam_size: int = 1
    # CTranslate2 threads on a CPU. auto: beside an in-process engine on this CPU, the cores its
    # forward leaves (at least one), as at the caller's pause the two run side by side (on two
    # cores, four threads slowed the reply prepared there: docs/BENCHMARKS.md, "Whisper beside
    # the engine at the pause"); without one, CTranslate2's default; 0: its default (4).
    cpu_threads: int | Literal["auto"] = "auto"
    # speech: the encoder runs on the utterance plus a margin, so a run costs what the speech is
    # long (~80-130 ms for tiny.en on two CPU cores), and a doubtful cut run is redone padded;
    # padded: Whisper's 30 s window, as faster-whisper runs it (~350 ms whatever the length).
    window: Literal["speech", "padded"] = "speech"
    window_margin_ms: int = 1000  # zero frames after the speech: a shorter context trails off
    # The shortest context: below ~10 s, tiny.en loops on short phrases ("Yes? Yes? Yes?"),
    # and a run over 10 s costs ~80 ms against ~50 ms over 3 s (two CPU cores).
    window_min_ms: int = 10000
    # Redo a cut run that holds digits on the padded window (once, at the caller's pause). Off:
    # on the project's speech the cut run misheard digits no more often than the padded one
    # (`voiceagent bench asr`, docs/BENCHMARKS.md), and the padded run costs ~3 cut runs.
    digits_padded: bool = False
    # Re-transcribe the growing utterance at this cadence while the caller speaks. A run on the
    # speech window is cheap, so the transcript at the caller's pause is mostly ready already.
    interim_every_ms: int = 400
    # At the caller's pause, an interim that missed at most the last 200 ms of audio and whose
    # words end a sentence ("...France?") starts the prepared reply at once; the pause's own
    # transcript follows and prepares again only if it hears other words (a run after the pause
    # costs ~100 ms).
    pause_interim: bool = True
    # One utterance is transcribed up to this long; the rest of it is dropped (a caller who never
    # pauses, or a line that streams noise, cannot grow the buffer or every re-transcription).
    max_utterance_s: float = 30.0
    # Audio kept from before the VAD start: it fires start_secs late, and at the start of a
    # stream, before Silero has context, up to ~0.7 s late (seen on Twilio calls).
    preroll_ms: int = 800

    def __post_init__(self) -> None:
        if self.cpu_threads != "auto" and self.cpu_threads < 0:
            raise ValueError(f"asr.cpu_threads must be auto, 0 (CTranslate2's default) or a "
                             f"count, not {self.cpu_threads}")


@dataclass
class TTSConfig:
    """Piper text-to-speech, synthesised clause by clause."""

    __pydantic_config__ = STRICT

    voice: str = "piper-joe-medium"
    use_cuda: bool = False
    cpu_threads: int = 0  # onnxruntime threads on a CPU; 0: its default (one per core)
    # Those threads spin-wait between ops (onnxruntime's default): a few percent faster alone,
    # but the spinning takes cycles from the engine and Whisper on the same cores.
    spin: bool = False
    length_scale: float = 1.0  # >1 speaks slower
    min_clause_chars: int = 6  # a shorter clause ("Hi,") waits to be spoken with the next one
    # The first phrase of a reply may end before a phrase opener ("with", "and") once it has
    # this many words, so speech starts sooner; 0: it ends at the first clause mark.
    first_phrase_words: int = 2
    # While Piper synthesises a reply's first chunk, the in-process engine steps none of that
    # call's requests submitted before it, up to this long: the chunk's audio gives what follows
    # a second or more, and beside the decoding it took twice its time alone; 0: off.
    first_phrase_hold_s: float = 0.3
    # A reply's later phrases are synthesised when the audio before them runs less than this
    # far ahead of the caller's playback, not all at once: another caller's reply, starting
    # meanwhile, gets the cores; 0: as fast as Piper goes.
    lead_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("first_phrase_hold_s", "lead_s"):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"tts.{name} must be 0 (off) or more, "
                                 f"not {getattr(self, name)}")
