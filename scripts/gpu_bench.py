"""The engine on a GPU at a realistic shape: a Llama-3-8B-shaped target, a Llama-3.2-1B draft.

    python3 scripts/gpu_bench.py                              # random weights, built on the GPU
    python3 scripts/gpu_bench.py --target DIR [--draft DIR]   # real checkpoints
    .venv/bin/python scripts/gpu_bench.py --device cpu --tiny # the same logic, tiny, on a CPU

At batch 1 a decode step reads every weight once, so it cannot beat weight bytes / memory
bandwidth: the HBM floor. How far the measured step sits above it is per-step overhead (kernel
launches, Python). Verifying k drafts runs k + 1 rows over the same weights, so where rows are
nearly free verify(k + 1 rows) costs about one step, which is what lets draft-then-verify pay
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"). The bench
measures both, then runs the engine's modes through start / step / release, greedy, each
generating exactly --new-tokens tokens (no EOS) on the same prompt.

Random weights make acceptance meaningless, so each row says what it shows:
- the prompt is a read-back: a prefix, the target's own greedy continuation of it, then the prefix
  again, so the target tends to say again what the prompt holds: where prompt lookup (`ngram`,
  Saxena 2023) pays;
- `draft` with the random 1B draft accepts about nothing: the cost of drafting without gain;
- `draft` with the target as its own draft accepts every draft (the acceptance upper bound), but
  each draft token costs a target step;
- the modelled rows are not runs: the measured 1B draft step and verify curve at an assumed
  acceptance, for what a trained 1B draft could give.

"Same tokens as off" holds exactly only where a forward of k + 1 rows rounds as one of 1 row does.
In bf16 the kernels differ by row count, and random weights put the top logits close together, so
a divergence there can be rounding; tests/llm_engine/test_gpu.py checks exactness in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llm_engine import kv  # noqa: E402
from llm_engine.compiled_runner import CompiledRunner  # noqa: E402
from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig  # noqa: E402
from llm_engine.engine import SpeculativeEngine  # noqa: E402
from llm_engine.loading import load_causal_lm, model_bytes  # noqa: E402
from llm_engine.runner import TargetRunner  # noqa: E402

SKIPPED = "no CUDA: skipped"
GGUF_CACHE = "~/.cache/voiceagent"  # de-quantised GGUF weights: the application's default place
MAX_ROWS = 16  # verify(k) is measured for 1 .. MAX_ROWS rows (k = rows - 1 drafts)
MODELLED_ACCEPTANCE = (1.0, 0.7)  # per-token acceptance of the modelled 1B-draft rows

# LlamaConfig shapes. The 1B ties its output head to the embeddings, as Llama 3.2 1B does.
SHAPES = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    "llama3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                        tie_word_embeddings=True),
    "tiny-target": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, vocab_size=512),
    "tiny-draft": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, vocab_size=512,
                       tie_word_embeddings=True),
}

# Peak memory bandwidth in TB/s by device name; the first pattern that matches wins, so the
# narrower names come first ("L40S" before "L4", "GH200" before "H200").
PEAK_TBPS = (
    (r"GH200.*HBM3e|GH200 144G", 4.9),
    (r"GH200", 4.0),
    (r"H200", 4.8),
    (r"H100 NVL", 3.9),
    (r"H100 PCIe", 2.0),
    (r"H100", 3.35),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"A100.*80GB PCIe", 1.94),
    (r"A100.*80GB", 2.04),
    (r"A100", 1.56),  # 40GB
    (r"L40S|L40\b", 0.864),
    (r"\bL4\b", 0.3),
    (r"A10G", 0.6),
    (r"\bA10\b", 0.6),
    (r"RTX 4090", 1.01),
    (r"\bT4\b", 0.32),
)

# A voice-agent turn, for the read-back prompt when a real tokenizer is loaded.
PASSAGE = (
    "You are a phone agent for a parcel company. Be brief and friendly. Caller: Hi, I'm calling "
    "about my order. The number is 4417-2290-XK and it was due yesterday. Agent: Thanks. Let me "
    "read that back: order 4417-2290-XK, due yesterday, to 18 Harbour Road, Leith. Is that right? "
    "Caller: Yes, and can you tell me when the driver will come? "
)


def peak_tbps(device_name: str) -> float | None:
    for pattern, tbps in PEAK_TBPS:
        if re.search(pattern, device_name):
            return tbps
    return None


# -- results, as data ---------------------------------------------------------------------------


@dataclass
class ModelInfo:
    label: str  # a shape name, or the checkpoint's file or folder name
    random_weights: bool
    params: int
    weight_bytes: int  # parameters and buffers, tied weights once
    build_s: float


@dataclass
class StepTiming:
    step_ms: float  # one forward of one row over the prompt's cache, measured
    floor_peak_ms: float | None  # weight bytes / peak bandwidth
    floor_copy_ms: float  # weight bytes / the bandwidth a device copy achieved


@dataclass
class ModeRun:
    label: str
    method: str
    draft: str | None  # "draft model", "target itself", or None
    gate: bool
    tokens_per_s: float  # decode rate, prefill excluded; median over repeats
    ms_per_token: float
    x_off: float | None
    acceptance: float | None  # accepted / drafted
    mean_k: float | None  # drafted tokens per speculative step
    diverges_at: int | None  # greedy: the first token that differs from plain decoding's
    shows: str


@dataclass
class Modelled:
    acceptance: float
    best_k: int
    tokens_per_s: float
    x_off: float  # against plain forwards (1 / step_ms): no engine overhead on either side


@dataclass
class BenchResult:
    device: str
    dtype: str
    peak_tbps: float | None
    peak_source: str  # "table", "--hbm-tbps" or "unknown"
    copy_tbps: float
    target: ModelInfo
    draft: ModelInfo | None
    target_step: StepTiming
    draft_step: StepTiming | None
    verify_ms: list[float]  # [rows - 1]: one forward of that many rows over the prompt's cache
    prompt_tokens: int
    new_tokens: int
    repeats: int
    modes: list[ModeRun] = field(default_factory=list)
    modelled: list[Modelled] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    total_s: float = 0.0

    @property
    def verify_ratios(self) -> list[float]:
        return [ms / self.verify_ms[0] for ms in self.verify_ms]


# -- timing -------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def once_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one fn() in ms, the device drained before and after: what a decode loop
    that reads its token every step pays."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1000.0


def timed_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median of `repeats` timings after one warm-up call."""
    fn()
    return statistics.median(once_ms(fn, device) for _ in range(repeats))


def copy_tbps(device: torch.device, nbytes: int, repeats: int) -> float:
    """Achievable memory bandwidth: a device-to-device copy reads nbytes and writes nbytes."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / (ms / 1000.0) / 1e12


def forward_ms(model: torch.nn.Module, context: torch.Tensor, rows: list[int], repeats: int,
               last_only: bool = False) -> list[float]:
    """Median ms of one cached forward of each row count on top of `context` ([1, n]), with the
    cache cropped back after each; row counts interleave so a stall spreads over all of them."""
    assert context.ndim == 2 and context.shape[0] == 1
    device = context.device
    length = context.shape[1]
    vocab = model.get_input_embeddings().num_embeddings
    cache = kv.new_cache(model)
    with torch.inference_mode():
        kv.forward(model, context, cache, last_only=True)
        times: dict[int, list[float]] = {r: [] for r in rows}
        for repeat in range(repeats + 1):  # the first pass warms each shape up
            for r in rows:
                ids = torch.randint(0, vocab, (1, r), device=device)  # [1, r]
                ms = once_ms(lambda ids=ids: kv.forward(model, ids, cache, last_only), device)
                kv.crop_to(cache, length)
                if repeat:
                    times[r].append(ms)
    return [statistics.median(times[r]) for r in rows]


def step_timing(step_ms: float, weight_bytes: int, peak: float | None,
                copy: float) -> StepTiming:
    floor_peak = weight_bytes / (peak * 1e12) * 1000.0 if peak else None
    return StepTiming(step_ms, floor_peak, weight_bytes / (copy * 1e12) * 1000.0)


# -- models -------------------------------------------------------------------------------------


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_random(shape: str, device: torch.device, dtype: torch.dtype,
                 seed: int) -> tuple[torch.nn.Module, ModelInfo]:
    """A random-weight Llama of this shape, allocated and initialised on the device in its
    dtype: no host copy, no float32 detour (16 GB of bf16 takes seconds on a GPU)."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    config = LlamaConfig(max_position_embeddings=8192, **SHAPES[shape])
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(config).eval()
    synchronize(device)
    return model, _info(shape, model, True, t0)


def load_real(path: str, device: torch.device, dtype: torch.dtype):
    t0 = time.perf_counter()
    loaded = load_causal_lm(path, device=str(device), dtype=str(dtype).removeprefix("torch."),
                            cache_dir=GGUF_CACHE,
                            progress=lambda msg: print(f"[gpu_bench] {msg}", flush=True))
    return loaded.model, loaded.tokenizer, _info(Path(path).name, loaded.model, False, t0)


def load_models(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """(target, draft or None, tokenizer or None, target info, draft info or None)."""
    if args.target:
        target, tokenizer, target_info = load_real(args.target, device, dtype)
        if not args.draft:
            return target, None, tokenizer, target_info, None
        draft, _, draft_info = load_real(args.draft, device, dtype)
        return target, draft, tokenizer, target_info, draft_info
    shapes = ("tiny-target", "tiny-draft") if args.tiny else ("llama3-8b", "llama3.2-1b")
    target, target_info = build_random(shapes[0], device, dtype, seed=0)
    draft, draft_info = build_random(shapes[1], device, dtype, seed=1)
    return target, draft, None, target_info, draft_info


def _info(label: str, model: torch.nn.Module, random_weights: bool, t0: float) -> ModelInfo:
    params = sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    return ModelInfo(label, random_weights, params, model_bytes(model), time.perf_counter() - t0)


# -- the engine's modes -------------------------------------------------------------------------


@dataclass(frozen=True)
class ModeSpec:
    label: str
    method: str
    draft: str | None  # which model drafts: "draft" (the draft model) or "target"
    gate: bool
    shows_random: str  # what the row shows when the weights are random
    shows_real: str


MODES = (
    ModeSpec("off", "off", None, False, "plain decoding: the baseline", "the baseline"),
    ModeSpec("ngram", "ngram", None, False,
             "prompt lookup on the read-back prompt", "prompt lookup on the read-back prompt"),
    ModeSpec("draft", "draft", "draft", False,
             "random draft, accepts ~nothing: drafting's cost without gain", "the draft model"),
    ModeSpec("draft, gated", "draft", "draft", True,
             "the same with the cost gate, which should close", "the draft model, cost gate on"),
    ModeSpec("draft = target", "draft", "target", False,
             "the target drafts for itself: accepts all, each draft costs a target step",
             "the target drafts for itself: accepts all, each draft costs a target step"),
)


def make_engines(target, draft, specs: list[ModeSpec], max_context: int,
                 runner: TargetRunner | None = None) -> dict[ModeSpec, SpeculativeEngine]:
    """An engine per (drafting model, gate), shared by the modes that need no other: each
    request names its method, and an engine measures its costs when built (seconds at 8B)."""
    built: dict[tuple[str | None, bool], SpeculativeEngine] = {}
    engines = {}
    for spec in specs:
        which = spec.draft or ("draft" if draft is not None else None)
        key = (which, spec.gate)
        if key not in built:
            config = EngineConfig(
                max_context=max_context,
                speculation=SpeculationConfig(method="draft" if which else "off", gate=spec.gate),
            )
            model = {"draft": draft, "target": target}.get(which)
            # No tokenizer: the bench feeds token ids. No EOS: every mode makes the same count.
            built[key] = SpeculativeEngine(target, None, config, draft_model=model,
                                           eos_token_ids=set(), runner=runner)
        engines[spec] = built[key]
    return engines


def run_request(engine: SpeculativeEngine, prompt: list[int], method: str, new_tokens: int):
    state = engine.start(prompt, SamplingConfig(max_new_tokens=new_tokens), method=method)
    try:
        while not state.finished:
            engine.step(state)
    finally:
        engine.release(state)
    return state


def run_modes(engines: dict[ModeSpec, SpeculativeEngine], prompt: list[int], new_tokens: int,
              repeats: int, random_weights: bool, log: Callable[[str], None]) -> list[ModeRun]:
    specs = list(engines)
    for s in specs:  # one-off costs (allocator, first calls of each shape) stay out of the figures
        run_request(engines[s], prompt, s.method, min(new_tokens, 16))
    rates: dict[ModeSpec, list[float]] = {s: [] for s in specs}
    states = {}
    for repeat in range(repeats):
        shift = repeat % len(specs)  # rotate the order, so no mode always runs first
        for s in specs[shift:] + specs[:shift]:
            state = run_request(engines[s], prompt, s.method, new_tokens)
            rates[s].append(state.stats.tokens_per_s or 0.0)
            states.setdefault(s, state)
        log(f"repeat {repeat + 1}/{repeats} done")
    off_rate = statistics.median(rates[specs[0]])
    off_tokens = states[specs[0]].output_ids
    runs = []
    for s in specs:
        stats = states[s].stats
        rate = statistics.median(rates[s])
        speculative = sum(1 for step in stats.steps if step.drafted)
        runs.append(ModeRun(
            label=s.label, method=s.method,
            draft={"draft": "draft model", "target": "target itself"}.get(s.draft), gate=s.gate,
            tokens_per_s=rate, ms_per_token=1000.0 / rate if rate else float("inf"),
            x_off=rate / off_rate if off_rate else None,
            acceptance=stats.acceptance_rate,
            mean_k=stats.drafted / speculative if speculative else None,
            diverges_at=first_difference(states[s].output_ids, off_tokens),
            shows=s.shows_random if random_weights else s.shows_real,
        ))
    return runs


def first_difference(a: list[int], b: list[int]) -> int | None:
    n = kv.common_prefix_len(a, b)
    return None if n == len(a) == len(b) else n


def prompt_prefix(length: int, tokenizer, models: list[torch.nn.Module]) -> list[int]:
    """The passage's tokens where there is a tokenizer, else random ids every model knows."""
    if tokenizer is not None:
        ids = tokenizer.encode(PASSAGE, add_special_tokens=False)
        return (ids * (length // len(ids) + 1))[:length]
    vocab = min(m.get_input_embeddings().num_embeddings for m in models)
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(0)).tolist()


def read_back_prompt(engine: SpeculativeEngine, prefix: list[int], new_tokens: int) -> list[int]:
    """prefix + its greedy continuation + prefix: after the second prefix the target tends to
    continue as it did after the first, which the prompt already holds."""
    continuation = run_request(engine, prefix, "off", new_tokens).output_ids
    return prefix + continuation + prefix


def modelled_rows(step_ms: float, draft_ms: float, verify_ms: list[float]) -> list[Modelled]:
    """Expected tokens per step (1 + a + ... + a^k) over k draft steps plus verify(k + 1 rows),
    at the best k the engine allows: its accounting, with measured costs and an assumed
    acceptance a."""
    max_k = min(SpeculationConfig().max_draft_tokens, len(verify_ms) - 1)
    rows = []
    for a in MODELLED_ACCEPTANCE:
        best = max(range(1, max_k + 1),
                   key=lambda k: sum(a**i for i in range(k + 1)) / (k * draft_ms + verify_ms[k]))
        tokens = sum(a**i for i in range(best + 1))
        ms = best * draft_ms + verify_ms[best]
        rows.append(Modelled(a, best, tokens / ms * 1000.0, tokens / ms * step_ms))
    return rows


# -- report -------------------------------------------------------------------------------------


def _f(value: float | None, fmt: str = ".2f", none: str = "–") -> str:
    return none if value is None else format(value, fmt)


def render_markdown(r: BenchResult) -> str:
    peak = f"{r.peak_tbps:.2f} TB/s ({r.peak_source})" if r.peak_tbps else "unknown (--hbm-tbps)"
    lines = [
        f"# Engine on {r.device} ({r.dtype})",
        "",
        f"Peak bandwidth {peak}; a device copy achieved {r.copy_tbps:.2f} TB/s. "
        f"Prompt {r.prompt_tokens} tokens (read-back), {r.new_tokens} new tokens, greedy, "
        f"median of {r.repeats}. Step / floor: against the peak floor where the peak is known.",
        "",
        "| model | weights | GB | built in s | step ms | floor ms (peak) | floor ms (copy) | "
        "step / floor |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for info, step in ((r.target, r.target_step), (r.draft, r.draft_step)):
        if info is None or step is None:
            continue
        floor = step.floor_peak_ms or step.floor_copy_ms
        lines.append(
            f"| {info.label} | {'random' if info.random_weights else 'real'} | "
            f"{info.weight_bytes / 1e9:.2f} | {info.build_s:.1f} | {step.step_ms:.2f} | "
            f"{_f(step.floor_peak_ms)} | {step.floor_copy_ms:.2f} | {step.step_ms / floor:.1f}× |")
    lines += [
        "",
        "verify(k): one target forward of k + 1 rows, as a multiple of one step (1 row):",
        "",
        "| rows | " + " | ".join(str(i + 1) for i in range(len(r.verify_ms))) + " |",
        "| --- | " + " | ".join("---:" for _ in r.verify_ms) + " |",
        "| × step | " + " | ".join(f"{x:.2f}" for x in r.verify_ratios) + " |",
        "",
        "| mode | drafts with | gate | tokens/s | ms/token | × off | accepted | mean k | "
        "same tokens as off | shows |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for m in r.modes:
        lines.append(
            f"| {m.label} | {m.draft or '–'} | {'on' if m.gate else 'off'} | "
            f"{m.tokens_per_s:.1f} | {m.ms_per_token:.2f} | {_f(m.x_off)} | "
            f"{_f(m.acceptance)} | {_f(m.mean_k, '.1f')} | "
            f"{'yes' if m.diverges_at is None else f'from token {m.diverges_at}'} | "
            f"{m.shows} |")
    for m in r.modelled:
        lines.append(
            f"| modelled | draft model | off | {m.tokens_per_s:.1f} | "
            f"{1000.0 / m.tokens_per_s:.2f} | {m.x_off:.2f} | {m.acceptance:.2f} | "
            f"{m.best_k} | – | not a run: measured draft step and verify curve, acceptance "
            f"{m.acceptance:.1f} assumed, best k |")
    lines += ["", f"Total {r.total_s:.0f} s."]
    return "\n".join(lines) + "\n"


def write_results(result: BenchResult, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / "gpu_bench.md", out_dir / "gpu_bench.json"
    md.write_text(render_markdown(result))
    data = asdict(result)
    data["verify_ratios"] = result.verify_ratios
    js.write_text(json.dumps(data, indent=1) + "\n")
    return md, js


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny random models: the logic, in seconds")
    p.add_argument("--target", help="a checkpoint folder or GGUF file instead of random weights")
    p.add_argument("--draft", help="a checkpoint for the draft (needs --target)")
    p.add_argument("--hbm-tbps", type=float, help="peak memory bandwidth, TB/s (else a table)")
    p.add_argument("--prompt-tokens", type=int, help="the read-back prompt's two copies of its "
                   "prefix, without the continuation between them (default 512; tiny 64)")
    p.add_argument("--new-tokens", type=int, help="tokens per request (default 128; tiny 32)")
    p.add_argument("--repeats", type=int, help="timed runs per mode (default 2; tiny 1)")
    p.add_argument("--out", help="results folder (default $OUT, else results/)")
    p.add_argument("--runner", choices=["eager", "compiled"], default="eager",
                   help="the target runner: compiled = static cache + CUDA graphs (compiling "
                   "takes minutes at 8B; default eager)")
    args = p.parse_args(argv)
    if args.draft and not args.target:
        p.error("--draft needs --target: a real draft against a random target means nothing")
    if args.device == "cpu" and not (args.tiny or args.target):
        p.error("an 8B model on a CPU: use --tiny (or --target)")
    tiny = args.tiny
    args.prompt_tokens = args.prompt_tokens or (64 if tiny else 512)
    args.new_tokens = args.new_tokens or (32 if tiny else 128)
    args.repeats = args.repeats or (1 if tiny else 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(SKIPPED)
        return 0
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[gpu_bench {time.perf_counter() - t_start:5.1f}s] {msg}", flush=True)

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.hbm_tbps:
        peak, source = args.hbm_tbps, "--hbm-tbps"
    else:
        peak = peak_tbps(name) if device.type == "cuda" else None
        source = "table" if peak else "unknown"
    fast = device.type == "cuda" and not args.tiny
    timing_repeats = 10 if device.type == "cuda" else 3
    # Measured before the models are built, so the buffers fit beside nothing.
    bandwidth = copy_tbps(device, (2 << 30) if fast else (64 << 20), timing_repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the copy's 4 GiB back before the models take theirs
    log(f"{name}: device copy {bandwidth:.2f} TB/s, peak {peak or 'unknown'} TB/s")

    target, draft, tokenizer, target_info, draft_info = load_models(args, device, dtype)
    log(f"target {target_info.label}: {target_info.weight_bytes / 1e9:.2f} GB in "
        f"{target_info.build_s:.1f} s" + (f"; draft {draft_info.label}: "
        f"{draft_info.weight_bytes / 1e9:.2f} GB in {draft_info.build_s:.1f} s"
        if draft_info else ""))

    half = args.prompt_tokens // 2
    prefix = prompt_prefix(half, tokenizer, [m for m in (target, draft) if m is not None])
    specs = [s for s in MODES if s.draft != "draft" or draft is not None]
    max_context = 2 * (half + args.new_tokens) + 32
    runner = CompiledRunner(target, max_context) if args.runner == "compiled" else None
    engines = make_engines(target, draft, specs, max_context, runner)
    log(f"{len(set(engines.values()))} engines built")
    prompt = read_back_prompt(engines[MODES[0]], prefix, args.new_tokens)
    context = torch.tensor([prompt], device=device)  # [1, prompt length]

    verify = forward_ms(target, context, list(range(1, MAX_ROWS + 1)), timing_repeats)
    target_step = step_timing(verify[0], target_info.weight_bytes, peak, bandwidth)
    draft_step = None
    if draft is not None:
        draft_ms = forward_ms(draft, context, [1], timing_repeats, last_only=True)[0]
        draft_step = step_timing(draft_ms, draft_info.weight_bytes, peak, bandwidth)
    log(f"step {verify[0]:.2f} ms (floor {target_step.floor_copy_ms:.2f} ms at copy bandwidth); "
        f"verify 16 rows {verify[-1] / verify[0]:.2f}× a step")

    result = BenchResult(
        device=name, dtype=str(dtype).removeprefix("torch."), peak_tbps=peak, peak_source=source,
        copy_tbps=bandwidth, target=target_info, draft=draft_info, target_step=target_step,
        draft_step=draft_step, verify_ms=verify, prompt_tokens=len(prompt),
        new_tokens=args.new_tokens, repeats=args.repeats,
        versions={"torch": torch.__version__, "transformers": transformers.__version__},
    )
    result.modes = run_modes(engines, prompt, args.new_tokens, args.repeats,
                             target_info.random_weights, log)
    if draft_step is not None:
        result.modelled = modelled_rows(verify[0], draft_step.step_ms, verify)
    result.total_s = time.perf_counter() - t_start

    out_dir = Path(args.out or os.environ.get("OUT") or REPO / "results")
    md, js = write_results(result, out_dir)
    print(render_markdown(result), end="")
    log(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
