"""Speech from text with a Piper voice as one int16 array: scripted callers (tests, benches)."""

from __future__ import annotations

import numpy as np

from audio.wav import resample


def synthesize(voice, text: str, rate: int = 16000,
               length_scale: float | None = None) -> np.ndarray:
    """`text` spoken by a loaded PiperVoice, mono int16 at `rate`; `length_scale` > 1 speaks
    slower (None: the voice's own)."""
    from piper import SynthesisConfig

    config = SynthesisConfig(length_scale=length_scale)
    audio = np.concatenate([c.audio_int16_array for c in voice.synthesize(text, config)])
    return resample(audio, voice.config.sample_rate, rate)


def silence(seconds: float, rate: int = 16000) -> np.ndarray:
    return np.zeros(int(seconds * rate), np.int16)
