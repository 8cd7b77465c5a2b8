"""Resolve, load and check the engine's models named in the config; build the running engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llm_engine import compact_draft, cost_model, eagle_head, formats
from llm_engine.compiled_runner import CompiledRunner
from llm_engine.config import EngineConfig
from llm_engine.contract import compatibility, make_pair_card
from llm_engine.cost_model import CostModelCache
from llm_engine.engine import SpeculativeEngine
from llm_engine.errors import IncompatiblePairError
from llm_engine.formats import FormatResult
from llm_engine.loading import LoadedModel, load_causal_lm, model_bytes
from llm_engine.pair_card import PairCard
from llm_engine.prompts import encode_chat
from llm_engine.proposers import model_setting
from llm_engine.runner import EagerRunner, TargetRunner
from llm_engine.serving import AsyncEngine
from voiceagent.bench.prompt_sets import heldout_conversations
from voiceagent.models import resolve


def load_llm(
    name: str, engine: EngineConfig, cache_dir: str, progress: Callable[[str], None] = print,
    setting: str = "engine.target",
) -> LoadedModel:
    resolved = resolve(name, "llm", setting=setting)
    return load_causal_lm(
        resolved.location,
        name=name,
        device=engine.device,
        dtype=engine.format,
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
    location = resolve(engine.draft, "llm", setting="engine.draft").location
    if compact_draft.is_compact_draft(location):
        meta = compact_draft.read_meta(location)
        _check_trained_for(target, engine.draft, meta)
        progress(f"loading compact draft {engine.draft} ({meta['layers']} layers of the target, "
                 f"{meta['vocab_size']}-token head)")
        return _own_weights(engine.draft, location, target,
                            lambda: compact_draft.load(location, target.model),
                            compact_draft.own_parameters)
    return load_llm(engine.draft, engine, cache_dir, progress, setting="engine.draft")


def load_eagle(engine: EngineConfig, target: LoadedModel,
               progress: Callable[[str], None] = print) -> LoadedModel:
    """The EAGLE head of the `eagle` proposer, trained for this very target."""
    if not engine.eagle:
        raise ValueError("engine.speculation.method=eagle needs engine.eagle (a name or a path)")
    location = resolve(engine.eagle, "llm", setting="engine.eagle").location
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
    formats: list[FormatResult] = field(default_factory=list)  # when engine.format is auto

    def serve(self) -> AsyncEngine:
        """The engine on its worker thread, for asyncio callers."""
        return AsyncEngine(self.engine)


def build_runtime(
    engine_cfg: EngineConfig, cache_dir: str, progress: Callable[[str], None] = print,
    also: Collection[str] = (),
) -> LLMRuntime:
    """Load the target and what the configured method (and the methods in `also`, for a
    benchmark) drafts with, in the format that is fastest here (`engine.format: auto`); refuse an
    incompatible pair (IncompatiblePairError); record its card; measure (or reuse) its costs.
    """
    if engine_cfg.threads > 0:
        torch.set_num_threads(engine_cfg.threads)
    # The models the methods draft with ("grammar+draft" drafts with the draft model).
    methods = {model_setting(m) for m in {engine_cfg.speculation.method, *also}}
    measurements = CostModelCache(Path(cache_dir).expanduser() / "cost")
    target = load_llm(engine_cfg.target, engine_cfg, cache_dir, progress)
    format_results: list[FormatResult] = []
    if engine_cfg.format == "auto" and target.device == "cpu":
        target, format_results = _choose_format(target, engine_cfg, measurements, progress)
    draft = load_draft(engine_cfg, target, cache_dir, progress) if "draft" in methods else None
    eagle = load_eagle(engine_cfg, target, progress) if "eagle" in methods else None
    draft, eagle = (_in_format(d, target) for d in (draft, eagle))
    eagle_first = model_setting(engine_cfg.speculation.method) == "eagle"
    drafter, other = (eagle, draft) if eagle_first else (draft, eagle)
    card = make_pair_card(target, drafter, engine_cfg, resident_bytes(target, draft, eagle))
    if other is not None:
        compatibility(target, other)  # a benchmark's other draft is checked too
    runner = make_runner(engine_cfg, target.model)
    key = _cost_key(runner, target, draft, eagle, engine_cfg)
    costs = _cached(measurements, key, runner)
    if costs is None:
        progress(f"measuring the target's verify cost and drafting costs ({runner.format}, "
                 f"{runner.name} runner; cached in {measurements.folder})")
    engine = SpeculativeEngine(
        target.model, target.tokenizer, engine_cfg, draft.model if draft else None,
        eagle_head=eagle.model if eagle else None, runner=runner, cost_model=costs,
    )
    if costs is None:
        engine.cost_model.key = key
        measurements.save(engine.cost_model)
    return LLMRuntime(target, draft, card, engine, eagle, format_results)


# Held-out conversations the formats are compared on at load: ~1,000 tokens, a second or two.
AGREEMENT_TEXTS = 16


def make_runner(engine_cfg: EngineConfig, model: torch.nn.Module) -> TargetRunner:
    """engine.runner; auto: compiled on CUDA (CUDA graphs), eager on a CPU, where compiling
    costs minutes per row bucket at load and the static cache makes every step attend over the
    whole context (README, "Runners and formats")."""
    kind = engine_cfg.runner
    if kind == "auto":
        kind = "compiled" if next(model.parameters()).device.type == "cuda" else "eager"
    if kind == "compiled":
        return CompiledRunner(model, engine_cfg.max_context)
    return EagerRunner(model)


def _choose_format(target: LoadedModel, engine_cfg: EngineConfig, measurements: CostModelCache,
                   progress: Callable[[str], None]) -> tuple[LoadedModel, list[FormatResult]]:
    """The target in the fastest format here whose output stays close enough to fp32's."""
    spec = engine_cfg.speculation

    def measure(model: torch.nn.Module, fmt: str):
        runner = EagerRunner(model)
        key = {**_cost_key(runner, target, None, None, engine_cfg), "part": "verify"}
        costs = _cached(measurements, key, runner)
        if costs is None:
            progress(f"measuring the target's forward cost in {fmt}")
            costs = cost_model.CostModel(
                cost_model.measure_verify(runner, spec.max_draft_tokens + 1), 256, key=key)
            measurements.save(costs)
        return costs

    texts = [encode_chat(target.tokenizer, messages)
             for messages in heldout_conversations()[:AGREEMENT_TEXTS]]
    model, fmt, results = formats.choose(
        target.model, ["float32", "bfloat16"], measure, texts, spec.method,
        spec.max_draft_tokens, engine_cfg.format_min_agreement, progress)
    if model is target.model:
        return target, results
    return dataclasses.replace(target, model=model, dtype=fmt, param_bytes=model_bytes(model)), \
        results


def _cached(measurements: CostModelCache, key: dict, runner: TargetRunner):
    costs = measurements.load(key)
    return costs if costs is not None and cost_model.still_valid(costs, runner) else None


def _in_format(drafter: LoadedModel | None, target: LoadedModel) -> LoadedModel | None:
    """A drafter in the target's format (a compact draft or head is built over its tensors)."""
    if drafter is None or drafter.model is target.model:
        return drafter
    dtype = next(target.model.parameters()).dtype
    if next(drafter.model.parameters()).dtype == dtype:
        return drafter
    drafter.model.to(dtype)
    return dataclasses.replace(drafter, dtype=target.dtype, param_bytes=model_bytes(drafter.model))


def _cost_key(runner: TargetRunner, target: LoadedModel, draft: LoadedModel | None,
              eagle: LoadedModel | None, engine_cfg: EngineConfig) -> dict:
    return {
        **cost_model.machine_key(runner.device),
        "target": cost_model.model_key(target.model),
        "draft": cost_model.model_key(draft.model) if draft else None,
        "eagle": cost_model.model_key(eagle.model) if eagle else None,
        "format": runner.format,
        "runner": runner.name,
        "max_rows": engine_cfg.speculation.max_draft_tokens + 1,
    }
