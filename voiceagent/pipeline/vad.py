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

import numpy as np
from pipecat.audio.vad.silero import SileroOnnxModel, SileroVADAnalyzer
from pipecat.audio.vad.vad_analyzer import VADAnalyzer, VADParams, VADState
from pipecat.frames.frames import Frame, InputAudioRawFrame, VADUserStartedSpeakingFrame
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameDirection

from audio.config import VADConfig
from voiceagent.models import resolve
from voiceagent.pipeline.frames import (
    UserSpeechOnsetFrame,
    UserSpeechPausedFrame,
    UserSpeechResumedFrame,
    UserVoiceFellFrame,
    UserVoiceRisingFrame,
)

VOICED_RMS = 328  # -40 dBFS (16-bit): a window this loud carries sound, not line silence
ONSET_BACKTRACK_S = 0.4  # how far before Silero's first confident window speech may have begun
LOUD_GAP_S = 0.1  # quiet inside a run of loud windows that still leaves it one run


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
        self._analysed_bytes = 0
        self._loud_from: int | None = None  # where the run of loud windows up to now began
        self._quiet_bytes = 0  # quiet audio since the last loud window
        self._in_speech = False  # the VAD was speaking (or counting down its stop) last window
        # Silero is confident of the last window: the VAD's own start also waits for a smoothed
        # volume, which lags a word's onset by ~150 ms.
        self.voiced = False
        # The byte offset, in the audio analysed so far, of the first voiced window of the speech
        # now starting (None while quiet): the run of loud windows that leads into the first
        # window Silero is confident of, at most ONSET_BACKTRACK_S back. Silero's confidence
        # lags a word's first sound (a fricative, a soft onset) by a window or more, and the
        # VAD's own start lags it by start_secs and a smoothed volume.
        self.onset_byte: int | None = None

    def voice_confidence(self, buffer) -> float:
        confidence = super().voice_confidence(buffer)
        self.voiced = confidence >= self._params.confidence
        start, self._analysed_bytes = self._analysed_bytes, self._analysed_bytes + len(buffer)
        if self._vad_state not in (VADState.QUIET, VADState.STARTING):
            self._in_speech = True
            return confidence
        if self._in_speech:  # the speech before has ended: the next one is found afresh
            self._in_speech, self.onset_byte, self._loud_from = False, None, None
        samples = np.frombuffer(buffer, np.int16).astype(np.float64)
        if len(samples) and np.sqrt(np.mean(samples**2)) >= VOICED_RMS:
            self._loud_from = start if self._loud_from is None else self._loud_from
            self._quiet_bytes = 0
        else:  # a word's stop closure ("s-t-op") is a short quiet gap inside the run
            self._quiet_bytes += len(buffer)
            if self._quiet_bytes > LOUD_GAP_S * self.sample_rate * 2:
                self._loud_from = None
        if confidence < self._params.confidence:
            self.onset_byte = None
        elif self.onset_byte is None:
            earliest = start - int(ONSET_BACKTRACK_S * self.sample_rate) * 2
            loud = self._loud_from if self._loud_from is not None else start
            self.onset_byte = max(loud, earliest, 0)
        return confidence

    @property
    def rising(self) -> bool:
        """The caller's voice may be starting: quiet, or starting, with a voiced last window."""
        return self._vad_state == VADState.STARTING or (
            self._vad_state == VADState.QUIET and self.voiced)

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

    Frames out, besides VADProcessor's: UserSpeechOnsetFrame just before each
    VADUserStartedSpeakingFrame, UserSpeechPausedFrame at the first silent window after speech
    (the VAD is then counting down its `stop_secs`), UserSpeechResumedFrame when speech comes back
    before the VAD stop, UserVoiceRisingFrame at the first voiced window after quiet and
    UserVoiceFellFrame when it falls quiet again unconfirmed. All are broadcast, as the VAD frames
    are.
    """

    def __init__(self, *, vad_analyzer: RegistrySileroVADAnalyzer, **kwargs):
        super().__init__(vad_analyzer=vad_analyzer, **kwargs)
        self._analyzer = vad_analyzer
        self._state = VADState.QUIET
        self._rising = False  # a UserVoiceRisingFrame is out, not yet confirmed or fallen
        self._received_bytes = 0
        self._bytes_per_s = 0
        # The pipeline clock at the stream's position 0: the least, over the call, of a frame's
        # arrival minus its position in the stream. Caller audio comes as a continuous real-time
        # stream (Twilio media, WebRTC's track, a WAV played in real time), so the frame that
        # came soonest after it was spoken dates every position; the others waited in queues
        # while the cores were busy, by hundreds of ms under load.
        self._stream_zero_ns: int | None = None

    async def broadcast_frame(self, frame_cls: type[Frame], **kwargs):
        onset = self._analyzer.onset_byte
        if frame_cls is VADUserStartedSpeakingFrame and onset is not None and self._bytes_per_s:
            onset_ns = self._stream_zero_ns + int(onset * 1e9 / self._bytes_per_s)
            await super().broadcast_frame(UserSpeechOnsetFrame, onset_ns=onset_ns)
        await super().broadcast_frame(frame_cls, **kwargs)

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        if isinstance(frame, InputAudioRawFrame):
            self._bytes_per_s = 2 * frame.sample_rate * frame.num_channels
            position_ns = int(self._received_bytes * 1e9 / self._bytes_per_s)
            zero = self.get_clock().get_time() - position_ns
            if self._stream_zero_ns is None or zero < self._stream_zero_ns:
                self._stream_zero_ns = zero
            self._received_bytes += len(frame.audio)
        await super().process_frame(frame, direction)
        if not isinstance(frame, InputAudioRawFrame):
            return
        state, self._state = self._state, self._analyzer.state
        if state == VADState.SPEAKING and self._state == VADState.STOPPING:
            await self.broadcast_frame(UserSpeechPausedFrame)
        elif state == VADState.STOPPING and self._state == VADState.SPEAKING:
            await self.broadcast_frame(UserSpeechResumedFrame)
        rising = self._analyzer.rising
        if self._state in (VADState.SPEAKING, VADState.STOPPING):
            self._rising = False  # confirmed: the VAD's own frames speak for it now
        elif rising and not self._rising:
            self._rising = True
            await self.broadcast_frame(UserVoiceRisingFrame)
        elif self._rising and not rising and self._state == VADState.QUIET:
            self._rising = False
            await self.broadcast_frame(UserVoiceFellFrame)
