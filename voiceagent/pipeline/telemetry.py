"""Each finished turn as an OpenTelemetry trace (`telemetry.otlp_endpoint`), exported over OTLP/HTTP
with the official SDK, so a turn shows in the operator's own tracing system beside their other
services.

A turn sink, like the store: the spans are built from the finished TurnRecord, placed on the wall
clock from the turn's start and its breakdown, in the order the turn's time passes (a turn that
ran tools has "tool call" and "tools", with a span per call). The root span "turn" runs from the
caller starting to speak to the bot's first audio and carries the call id, the method and the
config hash; a barge-in is an event on it with its timings (the record keeps the barge-in's
length, not its start). The SDK's batch processor sends on its own thread: writing never waits
on the collector, and one that is down costs the traces only.
"""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import set_span_in_context

from voiceagent.config import Config, config_hash
from voiceagent.pipeline.turn_record import TurnRecord

# The turn's stages after the caller's speech, in the order they pass: (span, Breakdown field).
STAGES = (("vad hangover", "vad_hangover_ms"), ("asr final", "asr_final_ms"),
          ("transcript to request", "transcript_to_request_ms"), ("tool call", "tool_call_ms"),
          ("tools", "tools_ms"), ("first token", "first_token_ms"),
          ("first clause", "first_clause_ms"), ("tts first chunk", "tts_first_chunk_ms"),
          ("chunk to audio", "chunk_to_audio_ms"))


def telemetry_sink(cfg: Config) -> OtlpTurnSink | None:
    t = cfg.telemetry
    if not t.otlp_endpoint:
        return None
    return OtlpTurnSink(t.otlp_endpoint, t.service_name, t.headers, config_hash(cfg))


class OtlpTurnSink:
    def __init__(self, endpoint: str, service_name: str, headers: dict[str, str],
                 config_hash: str):
        self.config_hash = config_hash
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, headers=dict(headers), timeout=5)))
        self._tracer = self._provider.get_tracer("voiceagent")

    def write(self, record: TurnRecord) -> None:
        start = _ns(record.started_at)
        b, clocks = record.breakdown, record.clocks
        turn_end = start + _ns_of(b.user_speech_ms)
        first_audio = clocks.turn_end_to_first_audio_ms
        root = self._tracer.start_span("turn", start_time=start, attributes={
            "voiceagent.call_id": record.call_id,
            "voiceagent.turn": record.turn,
            "voiceagent.method": record.method,
            "voiceagent.config_hash": self.config_hash,
            "voiceagent.interrupted": record.interrupted,
            **_attrs("voiceagent.clock", {
                "request_to_first_token_ms": clocks.request_to_first_token_ms,
                "itl_mean_ms": clocks.itl_ms.mean,
                "turn_end_to_first_audio_ms": first_audio}),
        })
        under = set_span_in_context(root)
        at = self._span("user speech", start, turn_end, under)
        prep = record.preparation
        for name, field in STAGES:
            ms = getattr(b, field)
            if ms is None:
                continue
            if ms < 0:  # a prepared request went out before the transcript: no span, and the
                at += _ns_of(ms)  # stages after it start that much earlier
                continue
            span = self._tracer.start_span(name, context=under, start_time=at)
            inside = set_span_in_context(span)
            if field == "tools_ms":
                for call in record.tool_calls:  # one after another: the record keeps lengths
                    self._span(f"tool {call.name}", at, at + _ns_of(call.duration_ms), inside,
                               {"voiceagent.tool.name": call.name,
                                "voiceagent.tool.outcome": call.outcome})
            if field == "first_token_ms" and b.prefill_ms is not None:
                self._span("prefill", at, at + _ns_of(b.prefill_ms), inside)
            at += _ns_of(ms)
            span.end(end_time=at)
        if prep.prepared:
            # From the committed preparation's request to the VAD stop; empty at its request
            # when that went out after the stop (a pause transcript slower than the hangover).
            vad_stop = turn_end + _ns_of(b.vad_hangover_ms or 0)
            asked = vad_stop - _ns_of(prep.lead_ms or 0)
            self._span("prepare", asked, max(asked, vad_stop), under, {
                "voiceagent.prepare.committed": prep.committed,
                "voiceagent.prepare.discarded": prep.discarded})
        if record.barge_in_to_silence_ms is not None:
            root.add_event("barge-in", attributes=_attrs("voiceagent.barge_in", {
                "to_silence_ms": record.barge_in_to_silence_ms,
                "detection_ms": record.barge_in_detection_ms,
                "stopping_ms": record.interruption_to_silence_ms}))
        end = turn_end + _ns_of(first_audio) if first_audio is not None else max(at, turn_end)
        root.end(end_time=end)

    def _span(self, name: str, start: int, end: int, context,
              attributes: dict | None = None) -> int:
        """A span without children, from `start` to `end` (ns); returns its end."""
        span = self._tracer.start_span(name, context=context, start_time=start,
                                       attributes=attributes)
        span.end(end_time=end)
        return end

    def close(self) -> None:
        self._provider.shutdown()  # sends what is queued


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _ns_of(ms: float | None) -> int:
    return int((ms or 0) * 1e6)


def _attrs(prefix: str, values: dict) -> dict:
    return {f"{prefix}.{k}": v for k, v in values.items() if v is not None}
