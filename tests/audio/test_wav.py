import struct
import wave

import numpy as np
import pytest
import soundfile

from audio.wav import AudioFormatError, frames, read_wav, write_wav


def tone(freq: float, seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return amplitude * np.sin(2 * np.pi * freq * t)  # float in [-1, 1]


def dominant_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x.astype(np.float64)))
    return np.argmax(spectrum) * rate / len(x)


def riff(fmt: bytes, data: bytes) -> bytes:
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def fmt_chunk(tag: int, channels: int, rate: int, bits: int) -> bytes:
    align = channels * bits // 8
    return struct.pack("<HHIIHH", tag, channels, rate, rate * align, align, bits)


def write_stdlib(path, x: np.ndarray, rate: int, width: int):
    """x: float [n, channels] -> integer PCM of `width` bytes, written by the stdlib."""
    scale = 2 ** (8 * width - 1) - 1
    ints = np.round(x * scale).astype(np.int64)
    if width == 3:
        raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints.ravel())
    elif width == 1:  # 8-bit WAV is unsigned
        raw = (ints + 128).astype(np.uint8).tobytes()
    else:
        raw = ints.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(x.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)


def test_8khz_stereo_becomes_16khz_mono(tmp_path):
    x = tone(440, 1.0, 8000)
    write_stdlib(tmp_path / "a.wav", np.stack([x, x], axis=1), 8000, 2)
    y = read_wav(tmp_path / "a.wav", 16000)
    assert y.dtype == np.int16 and y.ndim == 1
    assert abs(len(y) - 16000) <= 2
    assert abs(dominant_hz(y, 16000) - 440) < 3
    assert 0.45 < np.abs(y).max() / 32768 < 0.55


def test_stereo_channels_are_averaged(tmp_path):
    x = tone(440, 0.5, 16000)
    write_stdlib(tmp_path / "a.wav", np.stack([x, np.zeros_like(x)], axis=1), 16000, 2)
    y = read_wav(tmp_path / "a.wav", 16000)
    assert 0.2 < np.abs(y).max() / 32768 < 0.3


def test_48khz_is_downsampled(tmp_path):
    write_stdlib(tmp_path / "a.wav", tone(1000, 1.0, 48000)[:, None], 48000, 2)
    y = read_wav(tmp_path / "a.wav", 16000)
    assert abs(len(y) - 16000) <= 2
    assert abs(dominant_hz(y, 16000) - 1000) < 3


def test_24bit_pcm_keeps_its_values(tmp_path):
    x = tone(300, 0.25, 16000, amplitude=0.9)
    write_stdlib(tmp_path / "a.wav", x[:, None], 16000, 3)
    y = read_wav(tmp_path / "a.wav", 16000)
    assert np.abs(y.astype(np.float64) / 32768 - x).max() < 2 / 32768


def test_extensible_float32_is_read(tmp_path):
    x = tone(440, 0.5, 22050).astype("<f4")
    soundfile.write(tmp_path / "a.wav", x, 22050, subtype="FLOAT", format="WAVEX")
    y = read_wav(tmp_path / "a.wav", 16000)
    assert abs(dominant_hz(y, 16000) - 440) < 3


def test_unsigned_8bit_is_centred(tmp_path):
    write_stdlib(tmp_path / "a.wav", tone(200, 0.5, 8000)[:, None] * 0.99, 8000, 1)
    y = read_wav(tmp_path / "a.wav", 8000)
    assert abs(float(y.mean())) < 300  # no DC offset from the unsigned encoding
    assert 0.45 < np.abs(y).max() / 32768 < 0.55


def test_write_then_read_is_lossless(tmp_path):
    x = (tone(440, 0.3, 24000) * 32767).astype(np.int16)
    write_wav(tmp_path / "a.wav", x, 24000)
    assert np.array_equal(read_wav(tmp_path / "a.wav", 24000), x)


def test_empty_file_is_a_clear_error(tmp_path):
    (tmp_path / "a.wav").write_bytes(b"")
    with pytest.raises(AudioFormatError, match="empty"):
        read_wav(tmp_path / "a.wav")


def test_non_wav_file_is_a_clear_error(tmp_path):
    (tmp_path / "a.wav").write_text("this is not audio at all\n")
    with pytest.raises(AudioFormatError, match="not a WAV"):
        read_wav(tmp_path / "a.wav")


def test_corrupt_header_is_a_clear_error(tmp_path):
    (tmp_path / "a.wav").write_bytes(riff(b"\x01\x00\x01\x00", b"\x00" * 100))
    with pytest.raises(AudioFormatError, match="corrupt"):
        read_wav(tmp_path / "a.wav")


def test_garbage_format_chunk_is_a_clear_error(tmp_path):
    (tmp_path / "a.wav").write_bytes(riff(b"\x07\x00", b"\x00" * 100))  # truncated fmt
    with pytest.raises(AudioFormatError, match="unreadable WAV"):
        read_wav(tmp_path / "a.wav")


def test_mulaw_wav_is_decoded(tmp_path):
    soundfile.write(tmp_path / "a.wav", tone(300, 0.5, 8000), 8000, subtype="ULAW")
    y = read_wav(tmp_path / "a.wav", 8000)
    assert abs(dominant_hz(y, 8000) - 300) < 3


def test_wav_without_samples_is_a_clear_error(tmp_path):
    write_wav(tmp_path / "a.wav", np.zeros(0, np.int16), 16000)
    with pytest.raises(AudioFormatError, match="no audio"):
        read_wav(tmp_path / "a.wav")


def test_truncated_data_chunk_is_read_up_to_the_end(tmp_path):
    x = (tone(440, 0.1, 16000) * 32767).astype("<i2")
    wav = riff(fmt_chunk(1, 1, 16000, 16), x.tobytes())[:-101]  # cut mid-sample
    (tmp_path / "a.wav").write_bytes(wav)
    assert len(read_wav(tmp_path / "a.wav", 16000)) == len(x) - 51


def test_frames_are_20ms_with_the_last_padded():
    chunks = list(frames(np.ones(16000 + 100, np.int16), 16000))
    assert len(chunks) == 51
    assert all(len(c) == 320 for c in chunks)
    assert chunks[-1][:100].all() and not chunks[-1][100:].any()
