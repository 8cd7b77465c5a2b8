"""Resolve, load and check the engine's models named in the config; build the running engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from llm_engine import compact_draft, eagle_head
from llm_engine.config import EngineConfig
from llm_engine.contract import IncompatiblePairError, compatibility, make_pair_card
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


def load_draft(engine: EngineConfig, target: LoadedModel, cache_dir: str,
               progress: Callable[[str], None] = print) -> LoadedModel:
    """The draft model of the `draft` proposer: a compact draft, any causal LM, or the target."""
    if not engine.draft:
        raise ValueError("engine.speculation.method=draft needs engine.draft (a name or a path)")
    if engine.draft == engine.target:
        return target  # target as its own draft (the sanity check): one copy
    location = resolve(engine.draft, "llm").location
    if compact_draft.is_compact_draft(location):
        meta = compact_draft.read_meta(location)
        _check_trained_for(target, engine.draft, meta)
        progress(f"loading compact draft {engine.draft} ({meta['layers']} layers of the target, "
                 f"{meta['vocab_size']}-token head)")
        return _own_weights(engine.draft, location, target,
                            lambda: compact_draft.load(location, target.model),
                            compact_draft.own_parameters)
    return load_llm(engine.draft, engine, cache_dir, progress)


def load_eagle(engine: EngineConfig, target: LoadedModel,
               progress: Callable[[str], None] = print) -> LoadedModel:
    """The EAGLE head of the `eagle` proposer, trained for this very target."""
    if not engine.eagle:
        raise ValueError("engine.speculation.method=eagle needs engine.eagle (a name or a path)")
    location = resolve(engine.eagle, "llm").location
    if not eagle_head.is_eagle_head(location):
        raise ValueError(f"engine.eagle={engine.eagle!r}: {location} holds no EAGLE head "
                         f"({eagle_head.META} and {eagle_head.WEIGHTS})")
    meta = eagle_head.read_meta(location)
    _check_trained_for(target, engine.eagle, meta)
    progress(f"loading EAGLE head {engine.eagle} ({meta['vocab_size']}-token head)")
    return _own_weights(engine.eagle, location, target,
                        lambda: eagle_head.load(location, target.model),
                        lambda m: m.state_dict())


def _check_trained_for(target: LoadedModel, name: str, meta: dict) -> None:
    """A trained draft runs over the target's own embeddings: only that target may use it."""
    if meta.get("target_file_sha256") != target.file_sha256:
        raise IncompatiblePairError(
            f"draft '{name}' was trained for a target with weights sha256 "
            f"{str(meta.get('target_file_sha256'))[:12]}..., not this target's "
            f"{str(target.file_sha256)[:12]}...; train one with scripts/train_draft.py")


def _own_weights(name: str, folder: str, target: LoadedModel, load, own_tensors) -> LoadedModel:
    """A LoadedModel for weights trained over the target: its tokenizer, its own bytes."""
    start = time.perf_counter()
    model = load()
    own = sum(t.numel() * t.element_size() for t in own_tensors(model).values())
    return dataclasses.replace(
        target, name=name, source=folder, gguf_file=None, revision=None,
        file_sha256=None, model=model, param_bytes=own,
        load_s=time.perf_counter() - start, from_cache=False,
    )


def resident_bytes(target: LoadedModel, *drafts: LoadedModel | None) -> int:
    """Memory of the target and its drafts: allocated CUDA memory on a GPU, else the weights'."""
    if target.device.startswith("cuda"):
        return torch.cuda.memory_allocated(torch.device(target.device))
    return target.param_bytes + sum(
        d.param_bytes for d in drafts if d is not None and d.model is not target.model)


@dataclass
class LLMRuntime:
    target: LoadedModel
    draft: LoadedModel | None
    card: PairCard
    engine: SpeculativeEngine
    eagle: LoadedModel | None = None

    def serve(self) -> AsyncEngine:
        """The engine on its worker thread, for asyncio callers."""
        return AsyncEngine(self.engine)


def build_runtime(
    engine_cfg: EngineConfig, cache_dir: str, progress: Callable[[str], None] = print,
    also: Collection[str] = (),
) -> LLMRuntime:
    """Load the target and what the configured method (and the methods in `also`, for a
    benchmark) drafts with; refuse an incompatible pair (IncompatiblePairError); record its card.
    """
    if engine_cfg.threads > 0:
        torch.set_num_threads(engine_cfg.threads)
    methods = {engine_cfg.speculation.method, *also}
    target = load_llm(engine_cfg.target, engine_cfg, cache_dir, progress)
    draft = load_draft(engine_cfg, target, cache_dir, progress) if "draft" in methods else None
    eagle = load_eagle(engine_cfg, target, progress) if "eagle" in methods else None
    drafter, other = (eagle, draft) if engine_cfg.speculation.method == "eagle" else (draft, eagle)
    card = make_pair_card(target, drafter, engine_cfg, resident_bytes(target, draft, eagle))
    if other is not None:
        compatibility(target, other)  # a benchmark's other draft is checked too
    engine = SpeculativeEngine(
        target.model, target.tokenizer, engine_cfg, draft.model if draft else None,
        eagle_head=eagle.model if eagle else None,
    )
    return LLMRuntime(target, draft, card, engine, eagle)
