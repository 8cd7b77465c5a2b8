"""Resolve, load and check the engine's models named in the config; build the running engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from llm_engine import compact_draft, compiled_runner, cost_model, eagle_head, formats, threads
from llm_engine.compiled_runner import CompiledRunner
from llm_engine.config import EngineConfig
from llm_engine.contract import compatibility, make_pair_card
from llm_engine.cost_model import CostModelCache
from llm_engine.engine import SpeculativeEngine
from llm_engine.errors import IncompatiblePairError
from llm_engine.formats import FormatResult
from llm_engine.lean import int_kernel
from llm_engine.lean import linear as lean_linear
from llm_engine.lean import llama as lean_llama
from llm_engine.lean.eagle import LeanEagleHead
from llm_engine.lean.runner import LeanRunner
from llm_engine.loading import LoadedModel, load_causal_lm, model_bytes
from llm_engine.methods import model_setting
from llm_engine.pair_card import PairCard
from llm_engine.prompts import encode_chat
from llm_engine.runner import EagerRunner, TargetRunner
from llm_engine.serving import EngineWorker
from voiceagent.models import resolve
from voiceagent.prompt_sets import heldout_conversations


def load_llm(
    name: str, engine: EngineConfig, cache_dir: str, progress: Callable[[str], None] = print,
    setting: str = "engine.target",
) -> LoadedModel:
    resolved = resolve(name, "llm", setting=setting)
    return load_causal_lm(
        resolved.location,
        name=name,
        device=engine.device,
        # A weight-only format (int8, q4) is built by the lean runner from the loaded weights.
        dtype=engine.format if engine.format in formats.FORMATS else "auto",
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
    threads: int | None = None  # the forward's CPU threads; None on a GPU

    def serve(self, restarts: int = 0) -> EngineWorker:
        """The engine on its worker thread, for asyncio callers (`restarts`: EngineWorker's)."""
        return EngineWorker(self.engine, restarts=restarts)


def build_runtime(
    engine_cfg: EngineConfig, cache_dir: str, progress: Callable[[str], None] = print,
    also: Collection[str] = (), beside: threads.Load | None = None,
) -> LLMRuntime:
    """Load the target and what the configured method (and the methods in `also`, for a
    benchmark) drafts with, in the format that is fastest here (`engine.format: auto`), on the
    thread count that is fastest beside the work that shares the cores (`beside`; alone when
    None) with `engine.threads: auto`; refuse an incompatible pair (IncompatiblePairError);
    record its card; measure (or reuse) its costs. Call it on the thread that runs the engine:
    torch's thread count is that thread's.
    """
    if engine_cfg.threads != "auto" and engine_cfg.threads > 0:
        torch.set_num_threads(engine_cfg.threads)
    int_kernel.use(engine_cfg.int_kernel == "auto")
    # The models the methods draft with ("grammar+draft" drafts with the draft model).
    methods = {model_setting(m) for m in {engine_cfg.speculation.method, *also}}
    measurements = CostModelCache(Path(cache_dir).expanduser() / "cost")
    target = load_llm(engine_cfg.target, engine_cfg, cache_dir, progress)
    format_results: list[FormatResult] = []
    if engine_cfg.format == "auto" and target.device == "cpu":
        runner, format_results = _choose_format(target, engine_cfg, measurements, progress)
    else:
        runner = make_runner(engine_cfg, target, engine_cfg.format, measurements)
    probed_at = torch.get_num_threads()
    _choose_threads(engine_cfg, runner, target, measurements, beside, progress)
    if isinstance(runner, LeanRunner) and torch.get_num_threads() != probed_at:
        # Its invariance probe and attention dtype were measured on other threads: again, on
        # the engine's (cached per thread count like them).
        runner = make_runner(engine_cfg, target, runner.format, measurements)
    if runner.format != target.dtype:
        target = dataclasses.replace(target, dtype=runner.format)  # the card names the format
    draft = load_draft(engine_cfg, target, cache_dir, progress) if "draft" in methods else None
    eagle = load_eagle(engine_cfg, target, progress) if "eagle" in methods else None
    draft, eagle = (_in_format(d, runner.model) for d in (draft, eagle))
    eagle_first = model_setting(engine_cfg.speculation.method) == "eagle"
    drafter, other = (eagle, draft) if eagle_first else (draft, eagle)
    card = make_pair_card(target, drafter, dataclasses.replace(engine_cfg, runner=runner.name),
                          resident_bytes(target, draft, eagle))
    if other is not None:
        compatibility(target, other)  # a benchmark's other draft is checked too
    key = _cost_key(runner, target, draft, eagle, engine_cfg)
    costs = _cached(measurements, key, runner)
    if costs is None:
        progress(f"measuring the target's verify cost and drafting costs ({runner.format}, "
                 f"{runner.name} runner; cached in {measurements.folder})")
    engine = SpeculativeEngine(
        runner.model, target.tokenizer, engine_cfg, _drafting(draft, runner, engine_cfg),
        eagle_head=_eagle_drafting(eagle, runner, engine_cfg), runner=runner, cost_model=costs,
    )
    if costs is None:
        engine.cost_model.key = key
        measurements.save(engine.cost_model)
    return LLMRuntime(target, draft, card, engine, eagle, format_results,
                      torch.get_num_threads() if runner.device.type == "cpu" else None)


def threads_beside(engine_cfg: EngineConfig, runtime: LLMRuntime, cache_dir: str,
                   beside: threads.Load, progress: Callable[[str], None] = print) -> int | None:
    """With `engine.threads: auto` on a CPU: the engine's thread count, of those up to its own
    (`runtime.threads`), that `llm_engine.threads` measures best while `beside` runs (speech
    recognition: the fewest within 5% of the fastest), measured once per machine and cached;
    None when it is the engine's own count, or where it could change a token: its logits differ
    from those on the engine's own count, or a drafter whose probabilities a sampled reply
    draws on (draft, eagle) is loaded, whose own logits are not compared. torch's threads are
    left as they were. Call it on the engine's thread (`EngineWorker.call`);
    `EngineWorker.share_cores` then steps on it while that work (or speech synthesis) runs."""
    if not runtime.threads or runtime.threads == 1:
        return None
    if runtime.draft is not None or runtime.eagle is not None:
        progress(f"the engine keeps {runtime.threads} threads beside {beside.name}: a drafter "
                 "is loaded")
        return None
    runner = runtime.engine.runner
    measurements = CostModelCache(Path(cache_dir).expanduser() / "cost")
    counts = [n for n in threads.candidates() if n <= runtime.threads]
    try:
        record = _choose_threads(engine_cfg, runner, runtime.target, measurements, beside,
                                 progress, counts, "engine threads while speech is recognised")
    finally:
        torch.set_num_threads(runtime.threads)
    chosen = record["chosen"] if record else None
    if chosen is None or chosen == runtime.threads:
        return None
    rows = max(engine_cfg.speculation.max_draft_tokens + 1, getattr(runner, "max_rows", 0))
    if not _identical_logits(runner, runtime.target, [chosen, runtime.threads], rows,
                             engine_cfg.prefill_chunk, measurements):
        progress(f"the engine keeps {runtime.threads} threads beside {beside.name}: its logits "
                 f"on {chosen} differ")
        return None
    return chosen


# A thread count measured while other work held the cores favours fewer threads (a team waits for
# its slowest thread): a record taken with this many cores' worth of other processes' work more
# than now (`threads.other_work`) is measured again. One measured during a test run here chose 1
# thread (7.7 ms a step against 7.6 on 2); on the idle machine 2 threads stepped in 3.8 ms
# against 5.0 (Intel Xeon, 2026-12-07).
BUSIER = 0.5


def _choose_threads(engine_cfg: EngineConfig, runner: TargetRunner, target: LoadedModel,
                    measurements: CostModelCache, beside: threads.Load | None,
                    progress: Callable[[str], None], counts: list[int] | None = None,
                    label: str = "engine.threads auto") -> dict | None:
    """With `engine.threads: auto` on a CPU of several cores: the count of `counts` (1, 2, 4,
    ... up to the cores when None) that `llm_engine.threads` measures fastest beside `beside`,
    measured once per machine, model, format and load, and cached; measured again where the record
    was taken beside `BUSIER` cores or more of other processes' work than there is now, or does
    not say. Sets torch's threads to it; returns the record (None: nothing chosen)."""
    counts = counts or threads.candidates()
    if engine_cfg.threads != "auto" or runner.device.type != "cpu" or len(counts) == 1:
        return None
    key = {**_runner_key(runner, target), "part": "threads", "counts": counts,
           "beside": beside.name if beside else "nothing"}
    record, others = measurements.load_record(key), threads.other_work()
    if record is not None and "other_work" not in record:
        progress("measuring the engine's threads again: the cached choice does not say how busy "
                 "the machine was")
        record = None
    elif record is not None and round(record["other_work"] - others, 2) >= BUSIER:
        progress(f"measuring the engine's threads again: the cached choice was measured beside "
                 f"other work ({record['other_work']:.1f} cores then, {others:.1f} now)")
        record = None
    if record is None:
        progress(f"measuring the engine's step on {', '.join(map(str, counts))} threads beside "
                 f"{key['beside']} ...")
        chosen, medians = threads.choose_threads(runner, counts, beside.run if beside else None)
        record = {"chosen": chosen, "step_ms": {str(n): round(ms, 2) for n, ms in medians.items()},
                  "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
                  "other_work": round(others, 2)}
        measurements.save_record(key, record)
    torch.set_num_threads(record["chosen"])
    steps = ", ".join(f"{n} thread{'s' * (n != '1')} {ms:.1f} ms"
                      for n, ms in record["step_ms"].items())
    progress(f"{label}: {record['chosen']} (a step beside {key['beside']}: {steps}; "
             f"measured {record['measured_at']})")
    return record


def _runner_key(runner: TargetRunner, target: LoadedModel) -> dict:
    """What a measurement of `runner`'s forward on this machine depends on, its threads aside."""
    machine = {k: v for k, v in cost_model.machine_key(runner.device).items() if k != "threads"}
    return {**machine, "target": cost_model.model_key(target.model), "format": runner.format,
            "runner": runner.name,
            "lean": lean_llama.REVISION if isinstance(runner, LeanRunner) else None}


def _identical_logits(runner: TargetRunner, target: LoadedModel, counts: list[int], rows: int,
                      chunk: int, measurements: CostModelCache) -> bool:
    """`threads.identical_logits`, checked once per machine, model file, format, runner set-up
    and counts, and cached (a few seconds at every start otherwise)."""
    lean = isinstance(runner, LeanRunner)
    key = {**_runner_key(runner, target), "part": "thread-invariance", "check": 1,
           "file": target.file_sha256, "counts": sorted(counts), "rows": rows, "chunk": chunk,
           "attention": str(runner.lean.attention_dtype) if lean else None,
           "probed": runner.probe_result if lean else None,
           "max_context": getattr(runner, "max_cache_len", None)}
    record = measurements.load_record(key)
    if record is None:
        record = {"identical": threads.identical_logits(runner, counts, rows, chunk),
                  "measured_at": datetime.now(UTC).isoformat(timespec="seconds")}
        measurements.save_record(key, record)
    return record["identical"]


# Held-out conversations the formats are compared on at load: ~1,000 tokens, a second or two.
AGREEMENT_TEXTS = 16


def make_runner(engine_cfg: EngineConfig, target: LoadedModel, fmt: str,
                measurements: CostModelCache | None = None) -> TargetRunner:
    """The target's runner in `fmt` (a concrete format). engine.runner auto: the lean forward for
    bfloat16, int8 and q4 where it covers the architecture; the HF model as loaded otherwise,
    compiled on CUDA (CUDA graphs), eager on a CPU, where compiling HF's model costs minutes per
    row bucket and its static cache makes every step attend over the whole context. The lean
    forward attends in the dtype measured fastest here; `measurements` caches that and the
    invariance probe's answer per machine."""
    model = target.model
    kind = engine_cfg.runner
    if kind == "auto":
        lean_fits = fmt in ("bfloat16", "int8", "q4") and lean_llama.supports(model) is None
        cuda = next(model.parameters()).device.type == "cuda"
        compiles = cuda and compiled_runner.supports(model) is None
        kind = "lean" if lean_fits and (not cuda or fmt != "bfloat16") else \
            ("compiled" if compiles else "eager")
    if kind == "lean":
        gguf = Path(target.source) if target.gguf_file else None
        max_rows = engine_cfg.speculation.max_draft_tokens + 1
        attention = _attention_dtype(model, fmt, max_rows, measurements)
        slots = engine_cfg.kv_pool_slots if engine_cfg.shared_forwards else 0
        key = {**cost_model.machine_key(next(model.parameters()).device), "part": "invariance",
               "target": cost_model.model_key(model), "file": target.file_sha256, "format": fmt,
               "attention": str(attention), "max_rows": max_rows, "probes": 3,
               "pool_slots": slots, "max_context": engine_cfg.max_context,
               "lean": lean_llama.REVISION}
        probed = measurements.load_record(key) if measurements else None
        runner = LeanRunner(model, fmt, engine_cfg.max_context, max_rows, gguf,
                            attention_dtype=attention, probed=probed, cache_slots=slots)
        if measurements and probed is None:
            measurements.save_record(key, runner.probe_result)
        return runner
    if fmt not in formats.FORMATS:
        raise ValueError(f"engine.format {fmt} needs engine.runner lean (or auto)")
    if fmt != target.dtype:
        model = formats.convert(model, fmt)
    if kind == "compiled":
        return CompiledRunner(model, engine_cfg.max_context)
    return EagerRunner(model)


def _attention_dtype(model: torch.nn.Module, fmt: str, max_rows: int,
                     measurements: CostModelCache | None) -> torch.dtype:
    """`lean_llama.fastest_attention_dtype`, measured once per machine and model shape."""
    key = {**cost_model.machine_key(next(model.parameters()).device), "part": "attention",
           "target": cost_model.model_key(model), "format": fmt, "max_rows": max_rows}
    cached = measurements.load_record(key) if measurements else None
    if cached is not None:
        return getattr(torch, cached["chosen"])
    chosen = lean_llama.fastest_attention_dtype(model, fmt, max_rows)
    if measurements:
        measurements.save_record(key, {"chosen": str(chosen).removeprefix("torch.")})
    return chosen


def _drafting(draft: LoadedModel | None, runner: TargetRunner, engine_cfg: EngineConfig):
    """What the draft proposer runs: on the lean runner's path when the target is on it (the
    target drafting for itself shares its runner), else the draft's HF model."""
    if draft is None:
        return None
    if not isinstance(runner, LeanRunner) or lean_llama.supports(draft.model) is not None:
        return draft.model
    if draft.model is runner.model:
        return runner
    return LeanRunner(draft.model, runner.format, engine_cfg.max_context,
                      engine_cfg.speculation.max_draft_tokens + 1, probe=False,
                      attention_dtype=runner.lean.attention_dtype)


def _eagle_drafting(eagle: LoadedModel | None, runner: TargetRunner, engine_cfg: EngineConfig):
    """The EAGLE head on the lean runner's path when the target is on it, else HF's layer."""
    if eagle is None:
        return None
    if not isinstance(runner, LeanRunner) or lean_llama.supports(eagle.model.layer) is not None:
        return eagle.model
    return LeanEagleHead(eagle.model, runner.format, engine_cfg.max_context,
                         runner.lean.attention_dtype)


def _choose_format(target: LoadedModel, engine_cfg: EngineConfig, measurements: CostModelCache,
                   progress: Callable[[str], None]) -> tuple[TargetRunner, list[FormatResult]]:
    """The target's runner in the fastest format here that keeps speculation lossless and its
    output close enough to fp32's. Measured once per machine, model and torch version, and
    cached, so every process on the machine runs the same format."""
    spec = engine_cfg.speculation
    candidates = ["float32", "bfloat16"]
    if engine_cfg.runner in ("auto", "lean") and lean_llama.supports(target.model) is None:
        candidates += [f for f in ("int8", "q4") if lean_linear.available(f, torch.device("cpu"))]
    choice_key = {**cost_model.machine_key(torch.device(target.device)), "part": "format",
                  "measured": "side by side", "attention": "measured",
                  "target": cost_model.model_key(target.model), "file": target.file_sha256,
                  "candidates": candidates, "runner": engine_cfg.runner,
                  "max_rows": spec.max_draft_tokens + 1,
                  "min_agreement": engine_cfg.format_min_agreement, "lean": lean_llama.REVISION}
    cached = measurements.load_record(choice_key)
    if cached is not None:
        progress(f"engine.format auto: {cached['chosen']} (measured on this machine "
                 f"{cached['measured_at']}; cached in {measurements.folder})")
        return make_runner(engine_cfg, target, cached["chosen"], measurements), \
            [FormatResult.from_dict(r) for r in cached["results"]]

    def measure(runners: dict[str, TargetRunner]) -> dict[str, cost_model.CostModel]:
        progress(f"measuring the target's forward cost in {', '.join(runners)}, side by side")
        curves = cost_model.measure_verify_side_by_side(list(runners.values()),
                                                        spec.max_draft_tokens + 1)
        return {fmt: cost_model.CostModel(curve, 256) for fmt, curve
                in zip(runners, curves, strict=True)}

    texts = [encode_chat(target.tokenizer, messages)
             for messages in heldout_conversations()[:AGREEMENT_TEXTS]]
    runner, fmt, results = formats.choose(
        candidates, lambda f: make_runner(engine_cfg, target, f, measurements), measure,
        make_runner(engine_cfg, target, "float32"), texts, spec.max_draft_tokens,
        engine_cfg.format_min_agreement, progress)
    measurements.save_record(choice_key, {
        "chosen": fmt, "results": [r.to_dict() for r in results],
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds")})
    return runner, results


def _cached(measurements: CostModelCache, key: dict, runner: TargetRunner):
    costs = measurements.load(key)
    return costs if costs is not None and cost_model.still_valid(costs, runner) else None


def _in_format(drafter: LoadedModel | None, target_model: torch.nn.Module
               ) -> LoadedModel | None:
    """A drafter in the dtype of the target model the runner holds (a compact draft or head is
    built over its tensors)."""
    if drafter is None or drafter.model is target_model:
        return drafter
    dtype = next(target_model.parameters()).dtype
    if next(drafter.model.parameters()).dtype == dtype:
        return drafter
    drafter.model.to(dtype)
    return dataclasses.replace(drafter, dtype=str(dtype).removeprefix("torch."),
                               param_bytes=model_bytes(drafter.model))


def _cost_key(runner: TargetRunner, target: LoadedModel, draft: LoadedModel | None,
              eagle: LoadedModel | None, engine_cfg: EngineConfig) -> dict:
    return {
        **cost_model.machine_key(runner.device),
        "target": cost_model.model_key(target.model),
        "draft": cost_model.model_key(draft.model) if draft else None,
        "eagle": cost_model.model_key(eagle.model) if eagle else None,
        "format": runner.format,
        "runner": runner.name,
        "rows": getattr(runner, "rows", "as-is"),  # the lean runner may pad short forwards
        "attention": str(runner.lean.attention_dtype) if isinstance(runner, LeanRunner) else None,
        "drafting": "lean" if isinstance(runner, LeanRunner) else "hf",  # draft and EAGLE head
        "max_rows": engine_cfg.speculation.max_draft_tokens + 1,
        "lean": lean_llama.REVISION if isinstance(runner, LeanRunner) else None,
    }
