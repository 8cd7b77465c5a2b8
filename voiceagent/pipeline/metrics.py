"""Our measurements as pipecat metrics, so they travel in `MetricsFrame`s like pipecat's own.

The clocks observer (voiceagent.pipeline.clocks) reads them; nothing important lives only in a log.
"""

from __future__ import annotations

from pipecat.metrics.metrics import MetricsData
from pydantic import ConfigDict

from llm_engine.stats import FinishReason, RequestStats


class EngineStatsMetricsData(MetricsData):
    """One LLM request's engine statistics.

    Pushed by ChatLLMService when a request ends, interrupted or not.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    request_id: str
    interrupted: bool
    finish_reason: FinishReason
    stats: RequestStats
    prepared: bool = False  # started before the caller's turn was confirmed
    discarded: bool = False  # prepared, then withdrawn: nobody heard it
    error: str | None = None  # why the request failed (finish_reason "error")


class RequestStartedMetricsData(MetricsData):
    """An LLM request began, for the turn being prepared (`prepared`) or answered. Its engine
    stats go to that turn: on a loaded machine a cancelled reply's stats can come after the
    next turn's preparation has begun."""

    request_id: str
    prepared: bool = False


class HeldAudioMetricsData(MetricsData):
    """Audio of a prepared reply that the held-reply gate dropped: synthesised, never played."""

    discarded_audio_ms: float


class TurnContinuesMetricsData(MetricsData):
    """The turn being heard goes on with the one before, whose reply was withdrawn as it began
    (`turn.continue_within_s`)."""


class ASRFinalMetricsData(MetricsData):
    """How long the final transcript took after the turn ended (VAD stop), and how it was made."""

    final_ms: float  # VAD stop -> final transcript pushed
    audio_ms: float  # length of the utterance transcribed
    reused_interim: bool  # the last interim already covered the speech, so it became the final
