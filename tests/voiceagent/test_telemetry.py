"""Each turn as an OpenTelemetry trace (`telemetry.otlp_endpoint`), checked at a real OTLP/HTTP
receiver started here that decodes the protobuf with opentelemetry-proto."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.audio.speech import silence, speech
from tests.voiceagent.turns import make_turn
from voiceagent.config import config_hash, load_config
from voiceagent.pipeline.telemetry import OtlpTurnSink
from voiceagent.pipeline.turn_record import ToolCall
from voiceagent.sim.call import simulate_call


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP traces endpoint: keeps every span it is sent, as protobuf messages."""

    def __init__(self):
        self.spans: list = []
        self.paths: list[str] = []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        self.server.paths.append(self.path)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.server.spans += list(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def _attrs(span) -> dict:
    return {a.key: next(v for _, v in a.value.ListFields()) for a in span.attributes}


def _tree(spans) -> tuple[object, dict[str, object]]:
    [root] = [s for s in spans if s.name == "turn"]
    return root, {s.name: s for s in spans if s is not root}


async def test_a_simulated_call_turn_arrives_as_a_span_tree(models, tmp_path, receiver):
    cfg = load_config(None, [f"paths.runs_dir={tmp_path}",
                             f"telemetry.otlp_endpoint={receiver.url}"])
    audio = np.concatenate([silence(0.5), speech("What is the capital of France?"),
                            silence(4.0)])
    result = await simulate_call(cfg, models, audio)  # its sinks are closed: the spans sent
    [turn] = result.turns
    root, children = _tree(receiver.spans)
    t0 = root.start_time_unix_nano
    for span in sorted(receiver.spans, key=lambda x: (x.start_time_unix_nano, x.name)):
        start, end = span.start_time_unix_nano - t0, span.end_time_unix_nano - t0
        print(f"{span.name:24} {start / 1e6:7.1f} ms -> {end / 1e6:7.1f} ms")
        assert end >= start, span.name
    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    assert _attrs(root)["voiceagent.call_id"] == result.call_id
    assert _attrs(root)["voiceagent.method"] == turn.method
    assert _attrs(root)["voiceagent.config_hash"] == config_hash(cfg)
    # A reply prepared at the caller's pause and committed was asked for before the final
    # transcript: "prepare" stands where "transcript to request" would (which one a run takes
    # depends on how fast the machine is at the pause).
    asked = "prepare" if turn.preparation.committed else "transcript to request"
    want = {"user speech", "vad hangover", "asr final", asked, "first token", "prefill",
            "first clause", "tts first chunk", "chunk to audio"}
    assert want <= set(children), sorted(children)
    for name, span in children.items():
        assert span.trace_id == root.trace_id, name
        parent = children["first token"].span_id if name == "prefill" else root.span_id
        assert span.parent_span_id == parent, name
    # The root runs from the caller starting to speak to the bot's first audio: clock 3 after
    # the speech ends.
    speech_end = children["user speech"].end_time_unix_nano
    assert (root.end_time_unix_nano - speech_end) / 1e6 == pytest.approx(
        turn.clocks.turn_end_to_first_audio_ms, abs=0.01)


def test_tool_calls_and_a_barge_in_are_in_the_trace(receiver):
    record = make_turn("c9", 2, interrupted=True)
    record.breakdown.tool_call_ms, record.breakdown.tools_ms = 90.0, 640.0
    record.tool_calls = [ToolCall("lookup_order", 600.0, 87, ok=True)]
    sink = OtlpTurnSink(receiver.url, "voiceagent-test", {}, "cfghash")
    sink.write(record)
    sink.close()
    root, children = _tree(receiver.spans)
    tool = children["tool lookup_order"]
    assert tool.parent_span_id == children["tools"].span_id
    assert (tool.end_time_unix_nano - tool.start_time_unix_nano) / 1e6 == pytest.approx(600.0)
    assert _attrs(tool) == {"voiceagent.tool.name": "lookup_order",
                            "voiceagent.tool.outcome": "ok"}
    [event] = root.events
    assert event.name == "barge-in"
    assert _attrs(event)["voiceagent.barge_in.to_silence_ms"] == 210.0


def test_a_preparation_asked_after_the_vad_stop_is_an_empty_span_at_its_request(receiver):
    record = make_turn("c9", 3)
    prep = record.preparation
    prep.prepared, prep.committed, prep.lead_ms = 1, True, -22.0  # asked 22 ms after the stop
    sink = OtlpTurnSink(receiver.url, "voiceagent-test", {}, "cfghash")
    sink.write(record)
    sink.close()
    _, children = _tree(receiver.spans)
    span, hangover = children["prepare"], children["vad hangover"]
    assert span.start_time_unix_nano == span.end_time_unix_nano
    assert (span.start_time_unix_nano - hangover.end_time_unix_nano) / 1e6 == pytest.approx(22.0)


def test_a_collector_that_is_down_costs_the_traces_only():
    sink = OtlpTurnSink("http://127.0.0.1:9/v1/traces", "voiceagent-test", {}, "cfghash")
    sink.write(make_turn("c1", 1))  # queued for the exporter's thread: returns at once
    sink.close()
