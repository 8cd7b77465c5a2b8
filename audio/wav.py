"""WAV files in and out: any WAV that libsndfile reads -> mono int16 at the rate we ask for.

Decoding is libsndfile's (through `soundfile`): it reads integer PCM of any width, IEEE float,
WAVE_FORMAT_EXTENSIBLE, A-law and mu-law WAVs. We only add the checks that give one-line errors,
the down-mix to mono and the resampling (soxr).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import soundfile
import soxr


class AudioFormatError(ValueError):
    """The file is not audio we can read; the message says what is wrong, in one line."""


def read_wav(path: str | Path, sample_rate: int = 16000) -> np.ndarray:
    """Read a WAV file as mono int16 at `sample_rate`: channels are averaged, then resampled.

    Raises AudioFormatError for a missing or empty file, a file that is not a WAV, a corrupt
    one, or a WAV with no audio.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError) as e:
        raise AudioFormatError(f"{path}: no such WAV file") from e
    samples, rate = decode_wav(data, name=str(path))
    return resample(samples, rate, sample_rate)


def decode_wav(data: bytes, name: str = "input") -> tuple[np.ndarray, int]:
    """Decode WAV bytes to mono int16 at the file's own rate; returns (samples [n], rate)."""
    if not data:
        raise AudioFormatError(f"{name}: the file is empty")
    if len(data) < 12 or data[:4] not in (b"RIFF", b"RF64") or data[8:12] != b"WAVE":
        raise AudioFormatError(f"{name}: not a WAV file (no RIFF/WAVE header)")
    try:
        x, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise AudioFormatError(f"{name}: unreadable WAV ({reason})") from None
    if x.shape[0] == 0:
        raise AudioFormatError(f"{name}: the WAV holds no audio samples")
    return _float_to_int16(x.mean(axis=1)), int(rate)  # [n, channels] -> [n]


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Resample mono int16 audio with soxr (high quality); a no-op when the rates match."""
    assert samples.ndim == 1, samples.shape
    if from_rate == to_rate or samples.size == 0:
        return samples.astype(np.int16, copy=False)
    y = soxr.resample(samples.astype(np.float32) / 32768.0, from_rate, to_rate, quality="HQ")
    return _float_to_int16(y)


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int) -> None:
    """Write int16 samples, [n] mono or [n, channels], as a 16-bit PCM WAV."""
    assert samples.ndim in (1, 2), samples.shape
    soundfile.write(str(path), samples.astype(np.int16, copy=False), sample_rate, subtype="PCM_16")


def frames(samples: np.ndarray, sample_rate: int, frame_ms: int = 20) -> Iterator[np.ndarray]:
    """Cut audio into `frame_ms` frames, as a transport sends them; the last is zero-padded."""
    assert samples.ndim == 1, samples.shape
    size = sample_rate * frame_ms // 1000
    for start in range(0, len(samples), size):
        frame = samples[start : start + size]
        if len(frame) < size:
            frame = np.concatenate([frame, np.zeros(size - len(frame), dtype=samples.dtype)])
        yield frame


def _float_to_int16(x: np.ndarray) -> np.ndarray:
    return np.clip(np.round(x * 32768.0), -32768, 32767).astype(np.int16)
