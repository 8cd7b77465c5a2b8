"""Admission by measured load: take a new call only while the turns measured lately say that the
calls in progress and the new one would still answer within the target.

Each finished turn leaves its clock 3 (turn end -> first audio), the part of it no load changes
(the VAD hangover and a tool's own run time) and how many calls were in progress when its record
was written. On two busy cores the rest of a turn's wait grows with the calls sharing them (every
stage queues behind the others'), so a turn measured with k calls in progress predicts
fixed + (clock 3 - fixed) x (n + 1) / k with n + 1. A new call is admitted while the p95 of that
prediction over the recent turns is within `server.admit_clock3_ms`; with no recent turn (an
idle process) it is admitted. `server.max_calls` stays the hard cap. k is counted when the
record is written, after the reply was spoken, so a call that ended meanwhile makes the
prediction err on the side of refusing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from voiceagent.figures import percentile
from voiceagent.pipeline.turn_record import TurnRecord

WINDOW_S = 120.0  # turns older than this say little about the load now
MAX_TURNS = 64


class Admission:
    """Also a turn sink (`TurnRecords`): each finished turn is recorded as it ends."""

    def __init__(self, target_ms: float, active_calls: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic):
        """target_ms: the clock 3 every call should keep; 0: admit up to max_calls."""
        self.target_ms = target_ms
        self._active_calls = active_calls
        self._clock = clock
        self._turns: deque[tuple[float, float, float, int]] = deque(maxlen=MAX_TURNS)

    def write(self, record: TurnRecord) -> None:
        b = record.breakdown
        fixed = (b.vad_hangover_ms or 0.0) + (b.tools_ms or 0.0)
        self.record(record.clocks.turn_end_to_first_audio_ms, self._active_calls(), fixed)

    def close(self) -> None:
        pass

    def record(self, clock3_ms: float | None, calls: int, fixed_ms: float = 0.0) -> None:
        """A finished turn: its clock 3, the part of it no load changes, and the calls in
        progress."""
        if clock3_ms is not None and calls > 0:
            fixed = min(fixed_ms, clock3_ms)
            self._turns.append((self._clock(), fixed, clock3_ms - fixed, calls))

    def predicted_p95_ms(self, calls: int) -> float | None:
        """Clock 3's p95 predicted with `calls` calls in progress; None without recent turns."""
        since = self._clock() - WINDOW_S
        scaled = [fixed + loaded * calls / at for t, fixed, loaded, at in self._turns
                  if t >= since]
        return percentile(scaled, 95)

    def refusal(self, active: int) -> str | None:
        """Why a new call must wait, with `active` calls in progress; None: admit it."""
        if self.target_ms <= 0 or active == 0:
            return None
        predicted = self.predicted_p95_ms(active + 1)
        if predicted is None or predicted <= self.target_ms:
            return None
        return (f"server busy: with {active + 1} calls a turn would wait {predicted:.0f} ms "
                f"(p95 predicted from the last turns) > {self.target_ms:.0f} ms, try again later")

    def headroom(self, active: int, max_calls: int) -> dict:
        """What `/healthz` shows a balancer: whether a call now would be taken (the hard cap
        included; a draining process answers /healthz with 503 instead)."""
        predicted = self.predicted_p95_ms(active + 1)
        return {"target_clock3_ms": self.target_ms,
                "next_call_clock3_p95_ms": None if predicted is None else round(predicted),
                "admits": active < max_calls and self.refusal(active) is None}
