"""What speculation costs on this machine: measured, not assumed.

One target forward of r rows (r = 1 is a plain decode step; r = k + 1 verifies k drafts) and each
proposer's drafting cost (a fixed part per proposal plus a part per drafted token) are timed at
load on the machine itself, and cached per (machine, model, format, runner). With a per-token
acceptance rate a, a step that drafts k tokens commits 1 + a + ... + a^k tokens on average, so
the best k maximises

    expected tokens (k, a) / (draft ms (k) + verify ms (k + 1 rows)),

and k = 0 (a plain step) wins when nothing beats 1 / plain ms. The verify curve is whatever the
kernels make it: with MKL in fp32, 3 rows can cost more than 4 (row blocks), in bf16 on a CPU with
AVX512-BF16, 8 rows can cost 1.15 plain steps. A short draft is padded up to a cheaper row count
when the curve says so (`rows`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

import torch

from llm_engine.config import SamplingConfig
from llm_engine.lean import int_kernel
from llm_engine.proposers.base import ProposeContext, Proposer
from llm_engine.runner import TargetRunner
from llm_engine.sampling import make_generator

_PAD_GAIN = 0.95  # pad to more rows only when that is clearly cheaper, not on timer noise
_GREEDY = SamplingConfig(temperature=0.0)


@dataclass
class DraftCost:
    fixed_ms: float  # per proposal (catching up on committed tokens, lookups)
    per_token_ms: float

    def ms(self, k: int) -> float:
        return 0.0 if k <= 0 else self.fixed_ms + self.per_token_ms * k


@dataclass
class CostModel:
    verify_ms: list[float]  # [r - 1]: one forward of r rows over `context` cached tokens
    context: int
    draft: dict[str, DraftCost] = field(default_factory=dict)  # by proposer method
    key: dict = field(default_factory=dict)  # what it was measured for
    measured_at: str = ""

    @property
    def plain_ms(self) -> float:
        return self.verify_ms[0]

    @property
    def max_rows(self) -> int:
        return len(self.verify_ms)

    def __post_init__(self) -> None:
        # Every padded row count once: rows() and best_k() run on the engine's step loop.
        self._padded = [self._pad(n) for n in range(1, self.max_rows + 1)]

    def rows(self, n: int) -> int:
        """The row count to run n rows as: n, or more when padding is clearly cheaper."""
        return n if n >= self.max_rows else self._padded[n - 1]

    def _pad(self, n: int) -> int:
        best = n
        for r in range(n + 1, self.max_rows + 1):
            if self.verify_ms[r - 1] < _PAD_GAIN * self.verify_ms[best - 1]:
                best = r
        return best

    def verify(self, rows: int) -> float:
        if rows <= self.max_rows:
            return self.verify_ms[self.rows(rows) - 1]
        # Past the measured curve: extend its last slope (only a misconfigured K gets here).
        slope = max(self.verify_ms[-1] - self.verify_ms[-2], 0.0) if self.max_rows > 1 else 0.0
        return self.verify_ms[-1] + slope * (rows - self.max_rows)

    def step_ms(self, method: str, k: int) -> float:
        draft = self.draft.get(method, DraftCost(0.0, 0.0))
        return draft.ms(k) + self.verify(k + 1)

    def best_k(self, method: str, acceptance: float, max_k: int) -> int:
        """The draft length with the most expected tokens per ms; 0 when plain decoding wins."""
        best, best_rate = 0, 1.0 / self.plain_ms
        tokens = power = 1.0  # expected_tokens(k, acceptance), built up as k grows
        for k in range(1, max_k + 1):
            power *= acceptance
            tokens += power
            rate = tokens / self.step_ms(method, k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def speedup(self, method: str, acceptance: float, max_k: int) -> float:
        """Predicted tokens per ms at the best k, as a multiple of plain decoding."""
        k = self.best_k(method, acceptance, max_k)
        return expected_tokens(k, acceptance) / self.step_ms(method, k) * self.plain_ms

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        draft = {m: DraftCost(**d) for m, d in data.get("draft", {}).items()}
        return cls(list(data["verify_ms"]), int(data["context"]), draft,
                   dict(data.get("key", {})), str(data.get("measured_at", "")))


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens one step commits when each of k drafts is accepted with this probability in turn
    (the accepted prefix, then one recovered or bonus token)."""
    return sum(acceptance**i for i in range(k + 1))


# -- measuring ---------------------------------------------------------------------------------


def measure_verify(runner: TargetRunner, max_rows: int, context: int = 256,
                   repeats: int = 5) -> list[float]:
    """Median ms of one forward of 1 .. max_rows rows over `context` cached tokens."""
    return measure_verify_side_by_side([runner], max_rows, context, repeats)[0]


def measure_verify_side_by_side(runners: list[TargetRunner], max_rows: int, context: int = 256,
                                repeats: int = 5) -> list[list[float]]:
    """`measure_verify` for several runners at once, interleaved: within each repeat every row
    count of every runner runs in turn, so that a stall from another process spreads over all of
    them instead of bending one curve, or one runner against another."""
    vocab = vocab_size(runners[0].model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context + max_rows), generator=generator)
    ids = ids.to(runners[0].device)
    caches = [runner.new_cache() for runner in runners]
    times = [[[] for _ in range(max_rows)] for _ in runners]
    with torch.inference_mode():
        for runner, cache in zip(runners, caches, strict=True):
            runner.forward(cache, ids[:, :context], last_only=True)
        for repeat in range(repeats + 1):  # the first pass warms allocators and kernels up
            for rows in range(1, max_rows + 1):
                for runner, cache, curve in zip(runners, caches, times, strict=True):
                    ms = timed_ms(runner.forward, runner.device, cache,
                                ids[:, context:context + rows])
                    runner.crop(cache, context)
                    if repeat:
                        curve[rows - 1].append(ms)
    return [[statistics.median(t) for t in curve] for curve in times]


def measure_drafting(proposer: Proposer, runner: TargetRunner, max_k: int, context: int = 256,
                     repeats: int = 5) -> DraftCost:
    """A proposer's cost for drafting 1 and max_k tokens, through its own interface, on top of
    `context` tokens (and their target features for a proposer that reads them)."""
    vocab = vocab_size(runner.model)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (context,), generator=generator).tolist()
    with torch.inference_mode():
        cache = runner.new_cache()
        out = runner.forward(cache, torch.tensor([tokens[:-1]], device=runner.device))
        proposer.begin(tokens)
        if proposer.uses_target_hidden:
            proposer.observe_target(tokens, out.hidden)
        times: dict[int, list[float]] = {1: [], max_k: []}
        for repeat in range(repeats + 1):
            for k in times:
                ctx = ProposeContext(tokens, k, _GREEDY, make_generator(0, runner.device))
                start = time.perf_counter()
                draft = proposer.propose(ctx)
                ms = (time.perf_counter() - start) * 1000.0
                proposer.update(0)
                tokens.append(draft.tokens[0] if draft.tokens else tokens[-1])  # one committed
                if proposer.uses_target_hidden:
                    proposer.observe_target(tokens, out.hidden[-1:])
                if repeat:
                    times[k].append(ms)
    proposer.release()
    one, many = statistics.median(times[1]), statistics.median(times[max_k])
    per_token = max(many - one, 0.0) / (max_k - 1) if max_k > 1 else one
    return DraftCost(max(one - per_token, 0.0), per_token)


def measure(runner: TargetRunner, max_rows: int, new_proposers: dict[str, Callable[[], Proposer]],
            context: int = 256, repeats: int = 5, key: dict | None = None) -> CostModel:
    verify_ms = measure_verify(runner, max_rows, context, repeats)
    draft = {method: measure_drafting(make(), runner, max_rows - 1, context, repeats)
             for method, make in new_proposers.items()}
    return CostModel(verify_ms, context, draft, key or {},
                     datetime.now(UTC).isoformat(timespec="seconds"))


def still_valid(costs: CostModel, runner: TargetRunner, tolerance: float = 1.6) -> bool:
    """Whether a cached cost model still describes this machine: one plain step timed now is not
    `tolerance`x faster than it. A measurement taken while something else held the CPU is then
    replaced by a calm one. A step slower now says the CPU is busy now, not that the cache is
    wrong: measuring again under that load would replace a good model with a bent one."""
    now = measure_verify(runner, 1, costs.context, repeats=3)[0]
    return now * tolerance >= costs.plain_ms


# -- the cache on disk ---------------------------------------------------------------------------


def machine_key(device: torch.device) -> dict:
    """What a measurement depends on besides the model: the processor, threads and kernels."""
    if device.type == "cuda":
        processor = torch.cuda.get_device_name(device)
    else:
        processor = cpu_model()
    return {
        "processor": processor,
        "cpu_flags": _cpu_flags_digest(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "platform": platform.machine(),
        "int_kernel": int_kernel.name() if device.type == "cpu" else "torch",
    }


def model_key(model: torch.nn.Module) -> str:
    """A short digest of a model's architecture and size (its config and parameter count)."""
    config = getattr(model, "config", None)
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else ""
    params = sum(p.numel() for p in model.parameters())
    return hashlib.sha256(f"{type(model).__name__}|{params}|{text}".encode()).hexdigest()[:16]


class CostModelCache:
    """One JSON file per measurement key under a folder; a changed key measures again."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder).expanduser()

    def path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.folder / f"{digest}.json"

    def load(self, key: dict) -> CostModel | None:
        path = self.path(key)
        try:
            model = CostModel.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return model if model.key == key else None

    def save(self, model: CostModel) -> None:
        self._write(model.key, model.to_dict())

    def load_record(self, key: dict) -> dict | None:
        """Another measurement stored under a key (the format choice), or None."""
        try:
            data = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and data.get("key") == key else None

    def save_record(self, key: dict, record: dict) -> None:
        self._write(key, {**record, "key": key})

    def _write(self, key: dict, data: dict) -> None:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")  # two processes may measure at once
        partial.write_text(json.dumps(data, indent=1))
        partial.replace(path)


def timed_ms(fn: Callable, device: torch.device, *args) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1000.0


def vocab_size(model: torch.nn.Module) -> int:
    return int(model.get_input_embeddings().num_embeddings)


@cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    """The processor's name, as /proc/cpuinfo gives it."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _cpu_flags_digest() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return hashlib.sha256(line.encode()).hexdigest()[:12]
    return ""
