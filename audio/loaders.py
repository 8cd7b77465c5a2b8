"""Load the audio models from local files (the model registry resolves names to paths)."""

from __future__ import annotations

from pathlib import Path


def load_whisper(model_dir: str | Path, device: str = "auto", compute_type: str = "auto"):
    from faster_whisper import WhisperModel

    if device == "auto":
        import ctranslate2

        device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    if compute_type == "auto":
        compute_type = "float16" if device == "cuda" else "int8"
    return WhisperModel(str(model_dir), device=device, compute_type=compute_type)


def load_piper(onnx_path: str | Path, use_cuda: bool = False):
    from piper import PiperVoice

    return PiperVoice.load(str(onnx_path), use_cuda=use_cuda)


def load_silero(onnx_path: str | Path):
    from silero_vad.utils_vad import OnnxWrapper

    return OnnxWrapper(str(onnx_path), force_onnx_cpu=True)
