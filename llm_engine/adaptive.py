"""Per-request control of speculation: the draft length K and the cost gate.

Neither changes what is generated, only how many tokens are drafted per step: verification is
lossless for any K, including K = 0 (plain decoding), and for drafts without q (n-gram, plain
steps) even a seeded sampled request gets the same tokens whatever K is (`llm_engine.verify`).
Only a seeded request with a sampling draft model runs without the gate: its random stream is
drawn in step order, so a timing-driven K schedule would change its tokens between runs.

- AdaptiveK: a fully accepted draft of length d sets K to at least 2d, so a read-back climbs
  4 -> 8 -> 10 in two steps (7 -> 11 with the CPU's row rounding below). Long drafts pay when
  they are accepted: on a CPU, verifying 8-12 rows costs ~1.3-1.8 plain steps and commits up to
  9-12 tokens (HF's prompt lookup drafts 10). Otherwise an EMA of the per-step acceptance rate
  moves K with hysteresis: +1 after `patience` steps at or above `grow_above`, halved after
  `patience` steps below `shrink_below`, nothing in the dead band between (no flapping). In the
  spirit of HF's "+2 when all accepted, -1 otherwise" and SGLang's accept-length tiers.
- CostGate: speculation pays when its cost per committed token, (draft + verify ms) over tokens
  per step, is below one plain decode step. The rule:
    close when  max(median step ms, plain ms) / mean committed per step  >=  plain ms,
  over the speculative steps since the gate (re)opened (a window of the last 8), once there are
  `min_steps` (2) of them. The floor at one plain step is physics, not tuning: verifying k + 1
  rows cannot be cheaper than one row, a lower reading is timer noise. So steps that accepted
  nothing (one token each) can never look profitable, and two of them close the gate whatever
  the timings; with ~0.5 accepted per step it stays open only if the step costs < 1.5 plain.
  A closed gate runs plain steps, then re-probes after `reprobe_steps` of them, a wait that
  doubles each time it closes. A re-probe drafts at most `probe_k` tokens (fewer rows to pay
  for) until it has passed `min_steps`; the first probe of a request uses the full K, as a
  read-back starts right away.
- fill_rows: the K actually drafted is rounded up so that the verify input (K + 1 rows) fills
  whole blocks of the CPU's matmul kernel (`verify_row_multiple`).
"""

from __future__ import annotations

import statistics
from collections import deque


def fill_rows(k: int, multiple: int) -> int:
    """The draft length >= k whose verify input (k + 1 rows) is a multiple of `multiple` rows.

    CPU matmul kernels work on blocks of rows. With MKL on the AMD EPYC this was measured on, a
    [rows, 576] x [576, 49152] output head takes 7.5 ms for 1 row, 16 for 2, 23 for 3, 13 for 4,
    23 for 7, 13 for 8, 25 for 11 and 15 for 12: leftover rows past a block of 4 are separate
    passes over the weights. A whole SmolLM2-135M verify follows (3 rows ~1.35x the cost of 4),
    so drafting 3 tokens is cheaper than drafting 2. k = 0 (a plain step) stays 0.
    """
    if k <= 0 or multiple <= 1:
        return k
    return -(-(k + 1) // multiple) * multiple - 1


class PlainStepCost:
    """Running estimate of one plain decode step in ms, shared by the requests of an engine.

    Fed by every step that drafted nothing: the `off` proposer, gated steps, n-gram misses.
    The median of a recent window, so one step stalled by another process doesn't swing it.
    """

    def __init__(self, window: int = 16, warmup_steps: int = 1):
        self.warmup_steps = warmup_steps
        self.samples = 0
        self._recent: deque[float] = deque(maxlen=window)
        self.ms: float | None = None

    @property
    def ready(self) -> bool:
        return self.ms is not None

    def observe(self, ms: float) -> None:
        self.samples += 1
        if self.samples <= self.warmup_steps:
            return  # the first decode steps of a process carry one-off allocation costs
        self._recent.append(ms)
        self.ms = statistics.median(self._recent)


class AdaptiveK:
    def __init__(
        self,
        k: int,
        min_k: int,
        max_k: int,
        enabled: bool = True,
        alpha: float = 0.5,
        grow_above: float = 0.8,
        shrink_below: float = 0.5,
        patience: int = 2,
    ):
        assert 0 <= min_k <= max_k and grow_above > shrink_below
        self.k = min(max(k, min_k), max_k)
        self.min_k, self.max_k, self.enabled = min_k, max_k, enabled
        self.alpha, self.grow_above, self.shrink_below = alpha, grow_above, shrink_below
        self.patience = patience
        self.acceptance: float | None = None  # EMA of accepted / drafted
        self._signal = 0
        self._streak = 0

    def observe(self, drafted: int, accepted: int) -> None:
        if not self.enabled or drafted == 0:
            return
        rate = accepted / drafted
        ema = (
            rate
            if self.acceptance is None
            else self.acceptance + self.alpha * (rate - self.acceptance)
        )
        self.acceptance = ema
        if accepted == drafted:
            # Jump, not step: a draft shorter than K (the n-gram's continuation ran out) says
            # nothing about longer ones, so K never shrinks here.
            self.k = min(max(self.k, 2 * drafted), self.max_k)
            self._signal = self._streak = 0
            return
        signal = 1 if ema >= self.grow_above else -1 if ema < self.shrink_below else 0
        self._streak = self._streak + 1 if signal == self._signal and signal else int(signal != 0)
        self._signal = signal
        if self._streak >= self.patience:
            k = self.k + 1 if signal > 0 else self.k // 2
            self.k = min(max(k, self.min_k), self.max_k)
            self._streak = 0


class CostGate:
    def __init__(
        self,
        plain: PlainStepCost,
        enabled: bool = True,
        min_steps: int = 2,
        reprobe_steps: int = 32,
        probe_k: int = 2,
        window: int = 8,
    ):
        assert min_steps >= 1 and probe_k >= 1
        self.plain = plain
        self.enabled = enabled
        self.min_steps = min_steps
        self.probe_k = probe_k
        self.open = True
        self.closed_count = 0  # how many times the gate closed in this request
        self._probing = False  # re-opened, and not yet past min_steps speculative steps
        self._reprobe_steps = reprobe_steps
        self._plain_left = 0
        self._step_ms: deque[float] = deque(maxlen=window)
        self._committed: deque[int] = deque(maxlen=window)

    def limit(self, k: int) -> int:
        """The draft length this step may use, given the controller's k: 0 means a plain step."""
        if not self.enabled:
            return k
        # Until one plain step has been measured there is nothing to compare against.
        if not self.open or not self.plain.ready:
            return 0
        return min(k, self.probe_k) if self._probing else k

    def observe(self, drafted: int, committed: int, ms: float) -> None:
        """Record one step: ms is its draft + verify time, committed the tokens it produced."""
        if drafted == 0:
            self.plain.observe(ms)
            if self.enabled and not self.open:
                self._plain_left -= 1
                if self._plain_left <= 0:
                    self._reopen()  # the text may have become repetitive
            return
        if not self.enabled:
            return
        self._step_ms.append(ms)
        self._committed.append(committed)
        if len(self._step_ms) < self.min_steps or not self.plain.ready:
            return
        if self.cost_per_token_ms >= self.plain.ms:
            self.open = False
            self.closed_count += 1
            self._plain_left = self._reprobe_steps
            self._reprobe_steps *= 2  # back off: each failed probe costs a few slow steps
        else:
            self._probing = False

    @property
    def cost_per_token_ms(self) -> float | None:
        """Median step time (floored at a plain step) over mean tokens per step.

        The median, so that a stall from another process moves it little.
        """
        if not self._step_ms:
            return None
        step_ms = statistics.median(self._step_ms)
        if self.plain.ready:
            step_ms = max(step_ms, self.plain.ms)
        return step_ms * len(self._committed) / sum(self._committed)

    def _reopen(self) -> None:
        self.open = True
        self._probing = True
        self._step_ms.clear()
        self._committed.clear()
