"""The speech models every call shares, loaded once per process: Whisper (ASR), the Piper voice
(TTS), Silero (VAD) and, when the turn ends on `smart_turn`, Smart Turn v3.

Each is safe to call from several threads (CTranslate2, onnxruntime); what is a call's own (the
VAD's recurrent state, Smart Turn's audio, the STT's transcript) lives in its services.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipecat.audio.vad.silero import SileroOnnxModel

from voiceagent.config import Config
from voiceagent.pipeline.stt import load_asr_model
from voiceagent.pipeline.tts import load_tts_voice
from voiceagent.pipeline.turns import load_smart_turn_session
from voiceagent.pipeline.vad import load_vad_model


@dataclass(frozen=True)
class SpeechModels:
    whisper: Any  # faster_whisper.WhisperModel
    voice: Any  # piper.PiperVoice
    vad: SileroOnnxModel
    smart_turn: Any | None = None  # onnxruntime.InferenceSession; None unless turn.stop needs it

    @classmethod
    def load(cls, cfg: Config, progress: Callable[[str], None] = print) -> SpeechModels:
        progress(f"loading ASR {cfg.asr.model} ...")
        whisper = load_asr_model(cfg.asr)
        progress(f"loading TTS voice {cfg.tts.voice} ...")
        voice = load_tts_voice(cfg.tts)
        vad = load_vad_model(cfg.vad)
        smart_turn = load_smart_turn_session() if cfg.turn.stop == "smart_turn" else None
        return cls(whisper, voice, vad, smart_turn)
