"""Per-request control of speculation: the draft length K and the cost gate.

Neither changes what is generated, only how many tokens are drafted per step: verification is
lossless for any K, including K = 0 (plain decoding), and for drafts without q (n-gram, plain
steps) even a seeded sampled request gets the same tokens whatever K is (`llm_engine.verify`).
A seeded request with a sampling draft model draws its random stream in step order, so its K
schedule must not follow live timings: its gate uses only the cost model's prediction (below),
and its tokens reproduce wherever the same cost model is loaded (the same machine and cache).

- DraftLength: K is the cost model's best draft length (`llm_engine.cost_model`) for the
  acceptance measured so far in this request: per drafted token, accepted / tried, with older
  steps decaying. A read-back accepts whole drafts and K climbs to its maximum at once; a
  conversation accepting a third of the tokens gets the short draft the verify curve pays for.
- CostGate: speculation pays when its cost per committed token, (draft + verify ms) over tokens
  per step, is below one plain decode step. It closes when either says no:
    measured: max(median step ms, plain ms) / mean committed per step  >=  plain ms,
    predicted: the cost model's best K at the measured acceptance is 0 (plain wins),
  over the speculative steps since the gate (re)opened (a window of the last 8), once there are
  `min_steps` (2) of them. The floor at one plain step is physics, not tuning: verifying k + 1
  rows cannot be cheaper than one row, a lower reading is timer noise. So steps that accepted
  nothing (one token each) can never look profitable, and two of them close the gate whatever
  the timings. A closed gate runs plain steps, then re-probes after `reprobe_steps` of them, a
  wait that doubles each time it closes. A re-probe drafts at most `probe_k` tokens (fewer rows
  to pay for) until it has passed `min_steps`; the first probe of a request uses the full K, as
  a read-back starts right away. A closed gate costs nothing: the proposer is not called.
"""

from __future__ import annotations

import statistics
from collections import deque

from llm_engine.cost_model import CostModel


class PlainStepCost:
    """Running estimate of one plain decode step in ms, shared by the requests of an engine.

    Fed by every step that drafted nothing: the `off` proposer, gated steps, n-gram misses.
    The median of a recent window, so one step stalled by another process doesn't swing it.
    """

    def __init__(self, window: int = 16, warmup_steps: int = 1, initial_ms: float | None = None):
        self.warmup_steps = warmup_steps
        self.samples = 0
        self._recent: deque[float] = deque(maxlen=window)
        self.ms: float | None = initial_ms  # the cost model's, until steps of this load are seen

    @property
    def ready(self) -> bool:
        return self.ms is not None

    def observe(self, ms: float) -> None:
        self.samples += 1
        if self.samples <= self.warmup_steps:
            return  # the first decode steps of a process carry one-off allocation costs
        self._recent.append(ms)
        self.ms = statistics.median(self._recent)


class DraftLength:
    """K from the cost model and the acceptance measured in this request."""

    def __init__(self, costs: CostModel | None, method: str, k: int, min_k: int, max_k: int,
                 enabled: bool = True, decay: float = 0.7):
        assert 0 <= min_k <= max_k and 0.0 < decay <= 1.0
        self.costs, self.method = costs, method
        self.initial = min(max(k, min_k), max_k)
        self.min_k, self.max_k, self.enabled, self.decay = min_k, max_k, enabled, decay
        self._accepted = 0.0  # decayed sums over drafted steps: accepted tokens,
        self._tried = 0.0  # and tokens the target judged (the accepted ones and the first miss)
        self._steps = 0

    @property
    def acceptance(self) -> float | None:
        return self._accepted / self._tried if self._tried else None

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self._accepted = self.decay * self._accepted + accepted
        self._tried = self.decay * self._tried + accepted + (accepted < drafted)
        self._steps += 1

    @property
    def best(self) -> int:
        """The cost model's best K now: 0 when plain decoding would be faster."""
        a = self.acceptance
        if not self.enabled or a is None or self.costs is None:
            return self.initial
        return self.costs.best_k(self.method, a, self.max_k)

    @property
    def k(self) -> int:
        return min(max(self.best, self.min_k), self.max_k)

    @property
    def pays(self) -> bool:
        """Whether drafting is predicted to beat plain steps. Judged on the acceptance with a
        prior of one accepted and one missed token that decays like the evidence (Laplace's rule
        at the start), so that two unlucky early steps of a sampled reply do not turn speculation
        off where verifying is nearly free, while a run of misses still does."""
        if not self.enabled or self.costs is None or not self._tried:
            return True
        weight = self.decay**self._steps
        prior = (self._accepted + weight) / (self._tried + 2.0 * weight)
        return self.costs.best_k(self.method, prior, self.max_k) > 0


class CostGate:
    def __init__(
        self,
        plain: PlainStepCost,
        enabled: bool = True,
        measured: bool = True,  # False: close on the cost model's prediction only, never timings
        min_steps: int = 2,
        reprobe_steps: int = 32,
        probe_k: int = 2,
        window: int = 8,
    ):
        assert min_steps >= 1 and probe_k >= 1
        self.plain = plain
        self.enabled = enabled
        self.measured = measured
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

    def observe(self, drafted: int, committed: int, ms: float, pays: bool = True) -> None:
        """Record one step: ms is its draft + verify time, committed the tokens it produced;
        `pays` is False when the cost model predicts plain decoding is faster at this acceptance.
        """
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
        if not pays or (self.measured and self.cost_per_token_ms >= self.plain.ms):
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
