"""Typed configuration of the engine, one dataclass per concern.

These are plain dataclasses so that `llm_engine` stays free of application dependencies.
`__pydantic_config__` lets the application's YAML loader validate them strictly (unknown keys
are refused) without this package importing pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

STRICT = {"extra": "forbid", "validate_assignment": True}
# Methods that draft with a model of their own (engine.draft, engine.eagle).
MODEL_METHODS = ("draft", "eagle")


@dataclass
class SamplingConfig:
    """How tokens are chosen. Applied identically to the target (p) and the draft (q)."""

    __pydantic_config__ = STRICT

    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables
    seed: int | None = None
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)


@dataclass
class SpeculationConfig:
    """Which proposer drafts tokens, and how many per step."""

    __pydantic_config__ = STRICT

    method: Literal["off", "ngram", "draft", "eagle"] = "ngram"
    num_draft_tokens: int = 4  # K at the start of a request
    adaptive: bool = True  # move K with measured acceptance
    min_draft_tokens: int = 1
    max_draft_tokens: int = 10  # a read-back accepts whole drafts; K doubles up to here
    # Turn speculation off for a request when drafting + verifying costs more than it saves.
    gate: bool = True
    gate_min_steps: int = 2  # speculative steps measured before the gate may close
    gate_reprobe_steps: int = 32  # plain steps before a closed gate tries again (doubles each time)
    gate_probe_draft_tokens: int = 2  # K cap while a re-opened gate probes
    # Round K up so that the K + 1 verified rows fill the matmul kernel's row blocks: 4 for MKL on
    # a CPU (3 rows cost more than 4 there), 1 (no rounding) where rows are nearly free (GPU).
    verify_row_multiple: int = 1
    ngram_min: int = 2  # a lone repeated token is a poor guess in free conversation
    ngram_max: int = 3


@dataclass
class EngineConfig:
    """The target model, the optional draft model, and where they run."""

    __pydantic_config__ = STRICT

    target: str = "smollm2-135m-instruct"
    draft: str | None = None  # a model name/path for method "draft"; the target itself is allowed
    eagle: str | None = None  # an EAGLE head (name/path) for method "eagle", trained for the target
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_context: int = 2048
    threads: int = 0  # CPU threads for torch; 0 keeps torch's default
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
