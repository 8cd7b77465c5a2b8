"""Resolve, load and check the engine's models named in the config; build the running engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llm_engine import compact_draft
from llm_engine.config import EngineConfig
from llm_engine.contract import IncompatiblePairError, make_pair_card
from llm_engine.engine import SpeculativeEngine
from llm_engine.loading import LoadedModel, load_causal_lm
from llm_engine.pair_card import PairCard
from llm_engine.serving import AsyncEngine
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
    location = resolve(engine.draft, "llm").location
    if compact_draft.is_compact_draft(location):
        return target, load_compact_draft(engine.draft, location, target, progress)
    return target, load_llm(engine.draft, engine, cache_dir, progress)


def load_compact_draft(name: str, folder: str, target: LoadedModel,
                       progress: Callable[[str], None]) -> LoadedModel:
    """A draft trained for this target (llm_engine.compact_draft): it runs over the target's own
    embeddings and tokenizer, so it is refused for any other target."""
    meta = compact_draft.read_meta(folder)
    if meta.get("target_file_sha256") != target.file_sha256:
        raise IncompatiblePairError(
            f"draft '{name}' was trained for a target with weights sha256 "
            f"{str(meta.get('target_file_sha256'))[:12]}..., not this target's "
            f"{str(target.file_sha256)[:12]}...; train one with scripts/train_draft.py")
    progress(f"loading compact draft {name} ({meta['layers']} layers of the target, "
             f"{meta['vocab_size']}-token head)")
    start = time.perf_counter()
    model = compact_draft.load(folder, target.model)
    own = sum(t.numel() * t.element_size() for t in compact_draft.own_parameters(model).values())
    return dataclasses.replace(
        target, name=name, source=folder, gguf_file=None, revision=None,
        file_sha256=None, model=model, param_bytes=own,
        load_s=time.perf_counter() - start, from_cache=False,
    )


def resident_bytes(target: LoadedModel, draft: LoadedModel | None) -> int:
    """Memory of the whole pair: allocated CUDA memory on a GPU, else the weights' bytes."""
    if target.device.startswith("cuda"):
        return torch.cuda.memory_allocated(torch.device(target.device))
    same = draft is None or draft.model is target.model
    return target.param_bytes + (0 if same else draft.param_bytes)


@dataclass
class LLMRuntime:
    target: LoadedModel
    draft: LoadedModel | None
    card: PairCard
    engine: SpeculativeEngine

    def serve(self) -> AsyncEngine:
        """The engine on its worker thread, for asyncio callers."""
        return AsyncEngine(self.engine)


def build_runtime(
    engine_cfg: EngineConfig, cache_dir: str, progress: Callable[[str], None] = print
) -> LLMRuntime:
    """Load the pair, refuse an incompatible one (IncompatiblePairError), record its card."""
    if engine_cfg.threads > 0:
        torch.set_num_threads(engine_cfg.threads)
    target, draft = load_pair(engine_cfg, cache_dir, progress)
    card = make_pair_card(target, draft, engine_cfg, resident_bytes(target, draft))
    engine = SpeculativeEngine(
        target.model, target.tokenizer, engine_cfg, draft.model if draft else None
    )
    return LLMRuntime(target, draft, card, engine)
