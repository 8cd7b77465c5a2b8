"""Per-request control of speculation: the draft length K and the cost gate.

Neither changes what is generated, only how many tokens are drafted per step: verification is
lossless for any K, including K = 0 (plain decoding). See `SpeculativeEngine` for how the gate
stays out of seeded sampled requests, whose random stream depends on the K schedule.

- AdaptiveK: an EMA of the per-step acceptance rate, with a dead band between the grow and shrink
  thresholds and a patience of consecutive signals (hysteresis), so K does not flap. In the spirit
  of SGLang's accept-length tiers and HF's "+2 when all accepted, -1 otherwise" heuristic.
- CostGate: speculation pays only when (draft ms + verify ms) per committed token is below the
  cost of one plain decode step. On a CPU a 4-token verify costs about 1.8 plain steps (see
  NOTES.md), so a proposer that rarely hits makes decoding slower; the gate then falls back to
  plain steps, and re-probes after a number of plain steps that doubles each time it closes.
"""

from __future__ import annotations

import statistics
from collections import deque


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
        signal = 1 if ema >= self.grow_above else -1 if ema < self.shrink_below else 0
        self._streak = self._streak + 1 if signal == self._signal and signal else int(signal != 0)
        self._signal = signal
        if self._streak >= self.patience:
            self.k = min(max(self.k + signal, self.min_k), self.max_k)
            self._streak = 0


class CostGate:
    def __init__(
        self,
        plain: PlainStepCost,
        enabled: bool = True,
        min_steps: int = 4,
        reprobe_steps: int = 32,
        window: int = 8,
    ):
        self.plain = plain
        self.enabled = enabled
        self.min_steps = min_steps
        self.open = True
        self.closed_count = 0  # how many times the gate closed in this request
        self._reprobe_steps = reprobe_steps
        self._plain_left = 0
        self._step_ms: deque[float] = deque(maxlen=window)
        self._committed: deque[int] = deque(maxlen=window)

    def allows(self) -> bool:
        """Whether this step may speculate."""
        if not self.enabled:
            return True
        # Until one plain step has been measured there is nothing to compare against.
        return self.open and self.plain.ready

    def observe(self, drafted: int, committed: int, ms: float) -> None:
        """Record one step: ms is its draft + verify time, committed the tokens it produced."""
        if drafted == 0:
            self.plain.observe(ms)
            if self.enabled and not self.open:
                self._plain_left -= 1
                if self._plain_left <= 0:
                    self.open = True  # re-probe: the text may have become repetitive
                    self._step_ms.clear()
                    self._committed.clear()
            return
        if not self.enabled:
            return
        self._step_ms.append(ms)
        self._committed.append(committed)
        if len(self._step_ms) >= self.min_steps and self.plain.ready:
            if self.cost_per_token_ms > self.plain.ms:
                self.open = False
                self.closed_count += 1
                self._plain_left = self._reprobe_steps
                self._reprobe_steps *= 2  # back off: each failed probe costs a few slow steps

    @property
    def cost_per_token_ms(self) -> float | None:
        """Median step time over mean tokens per step: a stall elsewhere moves the median little."""
        if not self._step_ms:
            return None
        return statistics.median(self._step_ms) * len(self._committed) / sum(self._committed)
