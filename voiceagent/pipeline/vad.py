"""Silero VAD for pipecat, running the model that ships in the `silero-vad` package.

pipecat's SileroVADAnalyzer loads the copy of silero_vad.onnx bundled inside pipecat. We keep its
windowing and its state-reset policy and only swap the model file, so the model we run is the
one the registry names (and the one `voiceagent doctor` reports).
"""

from __future__ import annotations

from pipecat.audio.vad.silero import SileroOnnxModel, SileroVADAnalyzer
from pipecat.audio.vad.vad_analyzer import VADParams

from audio.config import VADConfig
from voiceagent.models import resolve


class RegistrySileroVADAnalyzer(SileroVADAnalyzer):
    """pipecat's Silero analyzer over a given ONNX file; 16 kHz or 8 kHz input, 32 ms windows."""

    def __init__(self, onnx_path: str, *, sample_rate: int | None = None,
                 params: VADParams | None = None):
        super().__init__(sample_rate=sample_rate, params=params)
        self.model_path = onnx_path
        self._model = SileroOnnxModel(onnx_path, force_onnx_cpu=True)


def vad_params(cfg: VADConfig) -> VADParams:
    return VADParams(
        confidence=cfg.confidence,
        start_secs=cfg.start_secs,
        stop_secs=cfg.stop_secs,
        min_volume=cfg.min_volume,
    )


def make_vad(cfg: VADConfig, sample_rate: int | None = None) -> RegistrySileroVADAnalyzer:
    """The VAD analyzer for a pipecat VADProcessor (or a transport's input)."""
    path = resolve(cfg.model, "vad").location
    return RegistrySileroVADAnalyzer(path, sample_rate=sample_rate, params=vad_params(cfg))
