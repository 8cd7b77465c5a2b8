"""Test speech, synthesised offline with the embedded Piper joe voice: no audio files committed."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from audio.loaders import load_piper
from audio.synth import silence, synthesize
from voiceagent.models import resolve

__all__ = ["misheard", "piper_voice", "silence", "speech", "words"]


@lru_cache(maxsize=1)
def piper_voice():
    return load_piper(resolve("piper-joe-medium", "tts").location)


@lru_cache(maxsize=16)
def speech(text: str, rate: int = 16000) -> np.ndarray:
    """`text` spoken by Piper, as mono int16 at `rate`. Don't mutate the (cached) result."""
    out = synthesize(piper_voice(), text, rate)
    out.flags.writeable = False
    return out


def words(text: str) -> set[str]:
    return {w.strip(".,?!").lower() for w in text.split()}


def misheard(text: str, said: str) -> int:
    """How many of the words `said` a transcript `text` lacks. Tests allow one: Piper's and
    Whisper's kernels differ by CPU (one Intel CI machine heard "France" as another word after
    0.3 s of silence), and word error itself is measured by `voiceagent bench asr`."""
    return len(words(said) - words(text))
