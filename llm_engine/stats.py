"""Statistics returned as data: per step, per request, and running totals for server metrics.

Times are milliseconds from `time.perf_counter`. The fields are what speculation is judged by:
accepted tokens per step, rejection position, drafting and verification time separately,
time to first token and each inter-token latency.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

# How a request ended: its EOS, its token budget, a stop string, cancelled by its caller, failed.
FinishReason = Literal["eos", "length", "stop", "cancelled", "error"]


def decode_rate(token_times_ms: Sequence[float]) -> float | None:
    """Decode rate in tokens/s: tokens after the first over the time since the first (prefill
    excluded); None for fewer than two tokens."""
    times = token_times_ms
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) * 1000.0 / (times[-1] - times[0])


@dataclass
class StepStats:
    k: int  # draft length asked for (0: a plain step)
    drafted: int  # tokens the proposer returned (an n-gram miss gives 0)
    accepted: int
    rejection_pos: int | None  # first rejected draft index; None when all were accepted
    committed: int  # tokens this step emitted, after EOS / budget clipping
    draft_ms: float
    verify_ms: float  # target forward + verification
    grammar_drafted: int = 0  # of `drafted`, those a constrained request's grammar forced


@dataclass
class RequestStats:
    method: str
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # tokens actually run through the target at prefill
    reused_prefix_tokens: int = 0  # prompt tokens whose KV came from the session's last request
    prefill_ms: float | None = 0.0  # None: not known (a remote server did the prefill)
    ttft_ms: float | None = None  # from start() to the first token
    itl_ms: list[float] = field(default_factory=list)  # one per token after the first; 0 in a burst
    token_times_ms: list[float] = field(default_factory=list)  # each token's time since start()
    steps: list[StepStats] = field(default_factory=list)  # decode steps; prefill is not one
    k_history: list[int] = field(default_factory=list)  # K asked for at each step, 0 when gated
    drafted_by_pos: list[int] = field(default_factory=list)  # steps that drafted position i
    accepted_by_pos: list[int] = field(default_factory=list)  # steps that accepted position i
    accept_len_hist: list[int] = field(default_factory=list)  # [n] = speculative steps accepting n
    gated_off: bool = False  # the cost gate turned speculation off at least once
    finish_reason: FinishReason | None = None
    cancel_to_stop_ms: float | None = None  # a caller's cancel honoured; async layer may refine
    generated_tokens: int = 0
    total_ms: float = 0.0  # from start() to the finish

    def record_step(self, step: StepStats) -> None:
        self.steps.append(step)
        self.k_history.append(step.k)
        if step.drafted == 0:
            return
        _grow(self.drafted_by_pos, step.drafted)
        _grow(self.accepted_by_pos, step.drafted)
        _grow(self.accept_len_hist, step.drafted + 1)
        for i in range(step.drafted):
            self.drafted_by_pos[i] += 1
        for i in range(step.accepted):
            self.accepted_by_pos[i] += 1
        self.accept_len_hist[step.accepted] += 1

    def record_tokens(self, count: int, now_ms: float) -> None:
        if count == 0:
            return
        if self.ttft_ms is None:
            self.ttft_ms = now_ms
            self.itl_ms.extend([0.0] * (count - 1))
        else:
            self.itl_ms.append(now_ms - self.token_times_ms[-1])
            self.itl_ms.extend([0.0] * (count - 1))  # tokens of one step arrive together
        self.token_times_ms.extend([now_ms] * count)
        self.generated_tokens += count

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def grammar_drafted(self) -> int:
        return sum(s.grammar_drafted for s in self.steps)

    @property
    def acceptance_rate(self) -> float | None:
        drafted = self.drafted
        return self.accepted / drafted if drafted else None

    @property
    def mean_accepted_per_step(self) -> float | None:
        spec = [s.accepted for s in self.steps if s.drafted]
        return sum(spec) / len(spec) if spec else None

    @property
    def tokens_per_s(self) -> float | None:
        return decode_rate(self.token_times_ms)

    @property
    def draft_ms(self) -> float:
        return sum(s.draft_ms for s in self.steps)

    @property
    def verify_ms(self) -> float:
        return sum(s.verify_ms for s in self.steps)

    def merge(self, later: RequestStats) -> RequestStats:
        """This request and a `later` one of the same turn (a tool call, then the reply) as one,
        of the later one's type: the per-token and per-step lists joined and the counts added, so
        the turn's ITL and speculation figures cover both generations; the times from a request's
        start (prefill, first token, token times, total) and the outcome stay the later one's,
        the one that spoke."""
        joined = {name: getattr(self, name) + getattr(later, name)
                  for name in ("itl_ms", "steps", "k_history", "prompt_tokens", "prefill_tokens",
                               "reused_prefix_tokens", "generated_tokens")}
        summed = {name: [sum(pair) for pair in itertools.zip_longest(
                      getattr(self, name), getattr(later, name), fillvalue=0)]
                  for name in ("drafted_by_pos", "accepted_by_pos", "accept_len_hist")}
        return dataclasses.replace(later, **joined, **summed,
                                   gated_off=self.gated_off or later.gated_off)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            drafted=self.drafted,
            accepted=self.accepted,
            grammar_drafted=self.grammar_drafted,
            acceptance_rate=self.acceptance_rate,
            mean_accepted_per_step=self.mean_accepted_per_step,
            tokens_per_s=self.tokens_per_s,
            draft_ms=self.draft_ms,
            verify_ms=self.verify_ms,
        )
        return out

    @classmethod
    def from_dict(cls, data: dict) -> RequestStats:
        """The inverse of `to_dict` (its derived keys are ignored): stats that travelled as JSON,
        e.g. from another process's OpenAI-compatible API."""
        names = {f.name for f in fields(cls)}
        step_names = {f.name for f in fields(StepStats)}
        known = {k: v for k, v in data.items() if k in names}
        known["steps"] = [StepStats(**{k: v for k, v in s.items() if k in step_names})
                          for s in known.get("steps") or []]
        known.setdefault("method", "unknown")
        return cls(**known)


@dataclass
class EngineTotals:
    """Running aggregates over finished requests, for the server's metrics."""

    requests: int = 0
    steps: int = 0
    speculative_steps: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    reused_prefix_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_by_pos: list[int] = field(default_factory=list)
    accepted_by_pos: list[int] = field(default_factory=list)
    gated_requests: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def add(self, request: RequestStats) -> None:
        self.requests += 1
        self.steps += len(request.steps)
        self.speculative_steps += sum(1 for s in request.steps if s.drafted)
        self.generated_tokens += request.generated_tokens
        self.prefill_tokens += request.prefill_tokens
        self.reused_prefix_tokens += request.reused_prefix_tokens
        self.drafted += request.drafted
        self.accepted += request.accepted
        _add_into(self.drafted_by_pos, request.drafted_by_pos)
        _add_into(self.accepted_by_pos, request.accepted_by_pos)
        self.gated_requests += int(request.gated_off)
        reason = request.finish_reason or "unknown"
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def to_dict(self) -> dict:
        return asdict(self)


def _grow(counts: list[int], size: int) -> None:
    if len(counts) < size:
        counts.extend([0] * (size - len(counts)))


def _add_into(total: list[int], part: list[int]) -> None:
    _grow(total, len(part))
    for i, value in enumerate(part):
        total[i] += value
