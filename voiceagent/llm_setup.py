"""Resolve and load the engine's target and draft models named in the config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llm_engine.config import EngineConfig
from llm_engine.loading import LoadedModel, load_causal_lm
from voiceagent.models import resolve


def load_llm(
    name: str, engine: EngineConfig, cache_dir: str, progress: Callable[[str], None] = print
) -> LoadedModel:
    resolved = resolve(name, "llm")
    return load_causal_lm(
        resolved.location,
        name=name,
        device=engine.device,
        dtype=engine.dtype,
        cache_dir=Path(cache_dir).expanduser(),
        progress=progress,
    )


def load_pair(
    engine: EngineConfig, cache_dir: str, progress: Callable[[str], None] = print
) -> tuple[LoadedModel, LoadedModel | None]:
    """The target, and the draft when the `draft` proposer is configured."""
    target = load_llm(engine.target, engine, cache_dir, progress)
    if engine.speculation.method != "draft":
        return target, None
    if not engine.draft:
        raise ValueError("engine.speculation.method=draft needs engine.draft (a name or a path)")
    if engine.draft == engine.target:
        return target, target  # target as its own draft (the sanity check): one copy
    return target, load_llm(engine.draft, engine, cache_dir, progress)
