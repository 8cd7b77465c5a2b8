"""Silero VAD for pipecat, running the model that ships in the `silero-vad` package.

pipecat's SileroVADAnalyzer loads the copy of silero_vad.onnx bundled inside pipecat. We keep its
windowing and its state-reset policy and only swap the model, so the model we run is the one the
registry names (and the one `voiceagent doctor` reports).

The ONNX session is created once per process (`load_vad_model`, held by SpeechModels) and shared
(onnxruntime's Run is thread-safe, and Silero's recurrent state lives in each call's copy of the
SileroOnnxModel, not in the session): creating one took about 25 ms, and a call's pipeline is
built on the event loop, where it stalls every other call's audio.
"""

from __future__ import annotations

import copy

from pipecat.audio.vad.silero import SileroOnnxModel, SileroVADAnalyzer
from pipecat.audio.vad.vad_analyzer import VADAnalyzer, VADParams, VADState
from pipecat.frames.frames import Frame, InputAudioRawFrame
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameDirection

from audio.config import VADConfig
from voiceagent.models import resolve
from voiceagent.pipeline.frames import UserSpeechPausedFrame, UserSpeechResumedFrame


def load_vad_model(cfg: VADConfig) -> SileroOnnxModel:
    """The Silero model the registry names; one per process, shared by every call's analyzer."""
    return SileroOnnxModel(str(resolve(cfg.model, "vad").location), force_onnx_cpu=True)


class RegistrySileroVADAnalyzer(SileroVADAnalyzer):
    """pipecat's Silero analyzer over a loaded model's session; 16 kHz or 8 kHz input, 32 ms
    windows."""

    def __init__(self, model: SileroOnnxModel, *, sample_rate: int | None = None,
                 params: VADParams | None = None):
        # SileroVADAnalyzer.__init__ would load pipecat's bundled model: set up what it sets up,
        # with our model instead.
        VADAnalyzer.__init__(self, sample_rate=sample_rate, params=params)
        self._model = copy.copy(model)  # shares the session only
        self._model.reset_states()
        self._windows_since_reset = 0
        self._low_confidence_windows = 0

    @property
    def state(self) -> VADState:
        """The analyzer's own state, STARTING and STOPPING included (the controller only
        reports SPEAKING and QUIET)."""
        return self._vad_state


def vad_params(cfg: VADConfig) -> VADParams:
    return VADParams(
        confidence=cfg.confidence,
        start_secs=cfg.start_secs,
        stop_secs=cfg.stop_secs,
        min_volume=cfg.min_volume,
    )


def make_vad(cfg: VADConfig, model: SileroOnnxModel,
             sample_rate: int | None = None) -> RegistrySileroVADAnalyzer:
    """One call's VAD analyzer, over the process's `model` (`load_vad_model`)."""
    return RegistrySileroVADAnalyzer(model, sample_rate=sample_rate, params=vad_params(cfg))


class PausingVADProcessor(VADProcessor):
    """pipecat's VADProcessor, plus the caller's pauses inside a turn.

    Frames out, besides VADProcessor's: UserSpeechPausedFrame at the first silent window after
    speech (the VAD is then counting down its `stop_secs`), UserSpeechResumedFrame when speech
    comes back before the VAD stop. Both are broadcast, as the VAD frames are.
    """

    def __init__(self, *, vad_analyzer: RegistrySileroVADAnalyzer, **kwargs):
        super().__init__(vad_analyzer=vad_analyzer, **kwargs)
        self._analyzer = vad_analyzer
        self._state = VADState.QUIET

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if not isinstance(frame, InputAudioRawFrame):
            return
        state, self._state = self._state, self._analyzer.state
        if state == VADState.SPEAKING and self._state == VADState.STOPPING:
            await self.broadcast_frame(UserSpeechPausedFrame)
        elif state == VADState.STOPPING and self._state == VADState.SPEAKING:
            await self.broadcast_frame(UserSpeechResumedFrame)
