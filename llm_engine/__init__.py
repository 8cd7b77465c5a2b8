"""llm_engine: an in-process draft-target speculative decoding engine."""

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.engine import RequestState, SpeculativeEngine
from llm_engine.stats import EngineTotals, RequestStats, StepStats

__all__ = [
    "EngineConfig",
    "EngineTotals",
    "RequestState",
    "RequestStats",
    "SamplingConfig",
    "SpeculationConfig",
    "SpeculativeEngine",
    "StepStats",
]
