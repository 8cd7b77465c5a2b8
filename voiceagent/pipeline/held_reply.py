"""Hold a prepared reply's audio until its turn is confirmed; drop it when it is withdrawn.

pipecat's LLMService holds a speculative reply with its SpeculationGate, before the TTS. Early
preparation wants the first phrase synthesised before commit too, so that confirmed audio goes
out at once; the same gate therefore sits here, after the TTS, and the LLM service lets prepared
replies through (llm_service.py). A prepared reply starts with a PreparedResponseStartFrame; the
UserStoppedSpeakingFrame of its turn releases it, an EagerEndOfTurnCancelFrame or an
InterruptionFrame drops it (pipecat's gate semantics, turns/speculation_gate.py).
"""

from __future__ import annotations

from pipecat.frames.frames import (
    EagerEndOfTurnCancelFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseStartFrame,
    MetricsFrame,
    TTSAudioRawFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.turns.speculation_gate import SpeculationGate, SpeculationState

from voiceagent.pipeline.frames import PreparedResponseStartFrame, audio_seconds
from voiceagent.pipeline.metrics import HeldAudioMetricsData


class HeldReplyGate(FrameProcessor):
    """Frames in: the TTS's output and the turn frames. Frames out: the same, with a prepared
    reply's frames held from its start until commit and dropped on withdrawal; after a drop, a
    MetricsFrame[HeldAudioMetricsData] with the audio that was synthesised for nothing."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._gate = SpeculationGate(name=f"{self}::gate")
        self._held_audio_s = 0.0

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        was_holding = self._gate.state == SpeculationState.HOLDING
        if isinstance(frame, LLMFullResponseStartFrame):
            self._gate.begin_speculation(isinstance(frame, PreparedResponseStartFrame))
            if was_holding:  # the gate drops a held reply that a new one supersedes
                await self._dropped()
        elif was_holding and isinstance(frame, (EagerEndOfTurnCancelFrame, InterruptionFrame)):
            await self._dropped()
        for out, out_direction in self._gate.process(frame, direction):
            await self.push_frame(out, out_direction)
        if self._gate.state != SpeculationState.HOLDING:
            self._held_audio_s = 0.0  # released, or dropped
        elif isinstance(frame, TTSAudioRawFrame):
            self._held_audio_s += audio_seconds(frame)

    async def _dropped(self) -> None:
        """Report the held audio the gate is about to drop."""
        await self.push_frame(MetricsFrame(data=[HeldAudioMetricsData(
            processor=self.name, discarded_audio_ms=self._held_audio_s * 1000)]))
        self._held_audio_s = 0.0
