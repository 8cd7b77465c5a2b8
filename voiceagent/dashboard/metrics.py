"""`GET /metrics`: the clocks and speculation counters in Prometheus' text format.

prometheus-client renders the format; each app has its own registry, so several servers (tests)
in one process don't share counts. Updated as turns finish (a TurnSink) and as calls fail.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from voiceagent.pipeline.turn_record import TurnRecord

# Latency buckets in seconds: voice turns live between 0.1 s and a few seconds.
CLOCK_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)


class TurnMetrics:
    def __init__(self, active_calls: Callable[[], int], resident_bytes: Callable[[], float]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.turn_end_to_first_audio = Histogram(
            "voiceagent_turn_end_to_first_audio_seconds",
            "Clock 3: the caller stopped speaking -> the first bot audio left the transport",
            ["method"], buckets=CLOCK_BUCKETS, registry=r)
        self.request_to_first_token = Histogram(
            "voiceagent_request_to_first_token_seconds",
            "Clock 1: the LLM request -> its first token", ["method"],
            buckets=CLOCK_BUCKETS, registry=r)
        self.inter_token = Histogram(
            "voiceagent_inter_token_seconds", "Clock 2: time between successive tokens",
            ["method"], buckets=ITL_BUCKETS, registry=r)
        self.turns = Counter("voiceagent_turns", "Finished turns", ["method"], registry=r)
        self.interruptions = Counter(
            "voiceagent_interruptions", "Turns the caller interrupted", ["method"], registry=r)
        self.drafted = Counter(
            "voiceagent_drafted_tokens", "Draft tokens proposed, by position in the draft",
            ["method", "position"], registry=r)
        self.accepted = Counter(
            "voiceagent_accepted_tokens", "Draft tokens accepted, by position in the draft",
            ["method", "position"], registry=r)
        self.errors = Counter(
            "voiceagent_errors", "Calls that failed, and connections closed for bad input",
            ["kind"], registry=r)
        Gauge("voiceagent_active_calls", "Calls in progress",
              registry=r).set_function(active_calls)
        Gauge("voiceagent_engine_resident_bytes", "Memory held by the LLM pair",
              registry=r).set_function(resident_bytes)

    def write(self, record: TurnRecord) -> None:
        engine = record.engine or {}
        method = engine.get("method") or "unknown"
        self.turns.labels(method).inc()
        if record.interrupted:
            self.interruptions.labels(method).inc()
        for histogram, ms in (
            (self.turn_end_to_first_audio, record.clocks.turn_end_to_first_audio_ms),
            (self.request_to_first_token, record.clocks.request_to_first_token_ms),
        ):
            if ms is not None:
                histogram.labels(method).observe(ms / 1000)
        for ms in engine.get("itl_ms") or []:
            self.inter_token.labels(method).observe(ms / 1000)
        for counter, counts in ((self.drafted, engine.get("drafted_by_pos") or []),
                                (self.accepted, engine.get("accepted_by_pos") or [])):
            for position, n in enumerate(counts):
                if n:
                    counter.labels(method, str(position)).inc(n)

    def close(self) -> None:
        pass
