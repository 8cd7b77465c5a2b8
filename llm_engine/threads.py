"""How many CPU threads the engine's forward runs on: measured where it runs, beside other work.

A decode step of a small model is hundreds of short kernels. On an idle machine two threads make
it faster; beside other work (a voice agent's speech synthesis and recognition share the cores)
every kernel's OpenMP team waits for its slowest thread, and a thread that lost its core to the
other work holds up the whole step. Measured on a 2-core AMD EPYC (Zen 4) in calls: 2 threads
decoded at 43 ms a token, 1 thread at 28, against 18 and 21 alone. Which count wins depends on
the machine and on what runs beside the engine, so `choose_threads` times a plain step at each
candidate count while `load` (the caller's stand-in for that other work) runs, and the caller
caches the answer per machine.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from llm_engine.cost_model import timed_ms, vocab_size
from llm_engine.runner import TargetRunner

# A count within this of the fastest is as good: fewer threads leave more of the cores to others.
_TIE = 1.05


@dataclass(frozen=True)
class Load:
    """Work that shares the cores with the engine: `run()` is a context manager during which it
    runs; `name` tells one load from another where the choice is cached."""

    name: str
    run: Callable[[], AbstractContextManager]


def candidates(cores: int | None = None) -> list[int]:
    """1, 2, 4, ... up to the cores this process may run on, and that count itself."""
    cores = max(1, cores or len(os.sched_getaffinity(0)))
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return [*counts, cores]


def choose_threads(runner: TargetRunner, counts: list[int],
                   load: Callable[[], AbstractContextManager] | None = None,
                   context: int = 256, repeats: int = 15) -> tuple[int, dict[int, float]]:
    """The thread count of `counts` with the cheapest plain step (median ms over `repeats`, the
    counts interleaved so a stall weighs on all alike) while `load()` runs, or alone when it is
    None; the fewest threads as fast (`fewest_as_fast`). Sets torch's threads to it (the calling
    thread's, the one that runs the engine, and those torch starts later) and returns it with
    each count's median."""
    ids = torch.randint(0, vocab_size(runner.model), (1, context + 1),
                        generator=torch.Generator().manual_seed(0)).to(runner.device)
    cache = runner.new_cache()
    times: dict[int, list[float]] = {n: [] for n in counts}
    with torch.inference_mode(), load() if load else contextlib.nullcontext():
        runner.forward(cache, ids[:, :context], last_only=True)
        for repeat in range(repeats + 1):  # the first pass warms each team up
            for n in counts:
                torch.set_num_threads(n)
                ms = timed_ms(runner.forward, runner.device, cache, ids[:, context:])
                runner.crop(cache, context)
                if repeat:
                    times[n].append(ms)
    medians = {n: statistics.median(t) for n, t in times.items()}
    chosen = fewest_as_fast(medians)
    torch.set_num_threads(chosen)
    return chosen, medians


def other_work(window_s: float = 0.25) -> float:
    """Cores' worth of other processes' work over the next `window_s`: the machine's busy time
    (/proc/stat) less this process's own (os.times), so what this process ran before (loading,
    measuring) does not count. 0.0 where /proc/stat cannot be read."""
    def busy() -> float:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def own() -> float:
        times = os.times()
        return times.user + times.system

    try:
        machine, mine, start = busy(), own(), time.monotonic()
        time.sleep(window_s)
        machine, mine = busy() - machine, own() - mine
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, (machine - mine) / (time.monotonic() - start))


def fewest_as_fast(step_ms: dict[int, float]) -> int:
    """The fewest threads whose step is within `_TIE` of the fastest."""
    best = min(step_ms.values())
    return min(n for n, ms in step_ms.items() if ms <= best * _TIE)


def identical_logits(runner: TargetRunner, counts: list[int], rows: int = 11, chunk: int = 256,
                     context: int = 70) -> bool:
    """Whether every kind of forward the engine runs gives bit-identical logits and hidden states
    on each of `counts` threads: a prefill chunk of `chunk` tokens after `context` cached ones,
    decode rows alone, verifies of 2 .. `rows` rows, and one forward shared by two requests.
    With the runner's row invariance probed on one of the counts, a step's tokens are then the
    same on any of them, so the engine may change its count between steps
    (`EngineWorker.share_cores`) without a token depending on timing. torch's threads are left
    as they were."""
    ids = torch.randint(0, vocab_size(runner.model), (1, context + chunk + rows),
                        generator=torch.Generator().manual_seed(0)).to(runner.device)
    was = torch.get_num_threads()
    seen = []
    try:
        with torch.inference_mode():
            for n in counts:
                torch.set_num_threads(n)
                seen.append(_every_shape(runner, ids, rows, chunk, context))
    finally:
        torch.set_num_threads(was)
    return all(torch.equal(a, b) for other in seen[1:] for a, b in zip(seen[0], other,
                                                                       strict=True))


def _every_shape(runner: TargetRunner, ids: torch.Tensor, rows: int, chunk: int,
                 context: int) -> list[torch.Tensor]:
    cache, other = runner.new_cache(), runner.new_cache()
    runner.forward(other, ids[:, :context // 2], last_only=True)
    runner.forward(cache, ids[:, :context], last_only=True)
    outs = [runner.forward(cache, ids[:, context:context + chunk], last_only=True)]
    start = context + chunk
    outs += [runner.forward(cache, ids[:, start + j:start + j + 1]) for j in range(rows)]
    for width in range(2, rows + 1):
        runner.crop(cache, start)
        outs.append(runner.forward(cache, ids[:, start:start + width]))
    runner.crop(cache, start)
    outs += runner.forward_many([(cache, ids[:, start:start + 2]),
                                 (other, ids[:, context // 2:context // 2 + 1])])
    return [t for out in outs for t in (out.logits, out.hidden) if t is not None]
