"""deploy/nginx/voiceagent.conf in front of a real `voiceagent serve`, over TLS on loopback: health,
the redirect to HTTPS, the token, a signed Twilio call over wss, unbuffered live events, the
Host/Origin guard behind the proxy; and, against two stub processes, which requests stick to one
process (WebRTC signalling) and which spread.

One `serve` process (loaded once for the module) is the first upstream; the second upstream
entry is a port where nothing listens, as a process that is down or restarting would be.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import httpx
import pytest
import websockets
from twilio.request_validator import RequestValidator

from tests.audio.speech import speech
from tests.voiceagent.nginx_proc import (
    NGINX,
    PUBLIC_HOST,
    SERVER_ENV,
    TOKEN,
    TWILIO_AUTH,
    Front,
    Proxy,
)
from tests.voiceagent.server_proc import free_port, running_server
from voiceagent.sim.twilio_caller import TwilioCaller

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(NGINX is None, reason="nginx is not installed (scripts/setup.sh --dev)"),
]

REPLY_TIMEOUT_S = 60  # one reply from the subprocess server on a busy 2-core machine
LIVE_TIMEOUT_S = 5  # a stream's first bytes or an event, when nothing holds them back


@pytest.fixture(scope="module")
def proxy(tmp_path_factory) -> Iterator[Proxy]:
    folder = tmp_path_factory.mktemp("proxy")
    front = Front(folder)
    with running_server("--set", f"paths.runs_dir={folder}/runs",
                        "--set", f"server.public_url={front.public_url}", env=SERVER_ENV) as base, \
            front.running((urlsplit(base).port, free_port())) as proxy:
        yield proxy


async def test_healthz_answers_over_tls_through_the_proxy(proxy):
    async with proxy.client() as http:
        r = await http.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ready", r.text
    assert "max-age" in r.headers["strict-transport-security"]


async def test_plain_http_is_redirected_to_https(proxy):
    async with httpx.AsyncClient(headers={"Host": proxy.host}) as http:
        r = await http.get(f"{proxy.http_url}/dashboard?x=1")
    assert r.status_code == 301
    assert r.headers["location"] == f"https://{PUBLIC_HOST}/dashboard?x=1"


async def test_the_dashboard_api_needs_the_token_through_the_proxy(proxy):
    async with proxy.client() as http:
        refused = await http.get("/api/calls")
        allowed = await http.get("/api/calls", headers={"Authorization": f"Bearer {TOKEN}"})
    assert refused.status_code == 401
    assert allowed.status_code == 200 and "calls" in allowed.json(), allowed.text


async def test_metrics_are_not_served_through_the_balancer(proxy):
    async with proxy.client(Authorization=f"Bearer {TOKEN}") as http:
        r = await http.get("/metrics")
    assert r.status_code == 404  # per-process counters: scraped at each process's own port


async def test_a_signed_twilio_call_over_wss_hears_the_bot(proxy):
    async with proxy.twilio() as caller:
        await caller.start()
        said = await caller.say(speech("What is the capital of France?"))
        assert await caller.wait(lambda r: r.media_after(said.ended) is not None and r.marks,
                                 REPLY_TIMEOUT_S), caller.received
        assert caller.received.audio_seconds() > 0.5
        assert caller.received.close_code is None, caller.received.close_reason
        await caller.hang_up()


async def test_a_twilio_call_signed_for_another_url_is_refused(proxy):
    ws = proxy.url.replace("https://", "wss://") + "/telephony/twilio"
    # Signed for the URL nginx connects to, not the public one Twilio would have used.
    signature = RequestValidator(TWILIO_AUTH).compute_signature(ws, {})
    async with TwilioCaller(ws, token=TOKEN,
                            headers={"X-Twilio-Signature": signature}) as caller:
        await caller.start(stream=False)
        await caller.wait(lambda r: r.close_code is not None, LIVE_TIMEOUT_S)
    assert (caller.received.close_code, caller.received.close_reason) == (
        1008, "invalid Twilio signature")


async def _line(lines, prefix: str) -> str:
    """The next line of the event stream that starts with `prefix`."""
    while not (line := await anext(lines)).startswith(prefix):
        pass
    return line


async def test_live_events_reach_the_dashboard_unbuffered(proxy):
    # A few bytes, then one event: a buffering proxy holds them (headers too) until its buffer
    # fills or the stream ends, and the client's read times out.
    try:
        async with proxy.client(LIVE_TIMEOUT_S, Authorization=f"Bearer {TOKEN}") as http, \
                http.stream("GET", "/api/events") as events:
            assert events.status_code == 200
            assert events.headers["content-type"].startswith("text/event-stream")
            lines = events.aiter_lines()
            assert await _line(lines, ":") == ": live"
            async with proxy.twilio() as caller:
                await caller.start(stream=False)
                line = await _line(lines, "data:")
                await caller.hang_up()
    except httpx.ReadTimeout:
        pytest.fail(f"the event stream sent nothing for {LIVE_TIMEOUT_S} s: buffered?")
    event = json.loads(line.removeprefix("data:"))
    assert event["kind"] == "twilio" and event["ended_at"] is None, event  # started


async def test_the_public_host_and_origin_are_admitted_through_the_proxy(proxy):
    async with proxy.client(Origin=f"https://{proxy.host}",
                            Authorization=f"Bearer {TOKEN}") as http:
        r = await http.get("/api/overview")
    assert r.status_code == 200, r.text


async def test_a_foreign_origin_or_host_is_refused_through_the_proxy(proxy):
    bearer = f"Bearer {TOKEN}"
    async with proxy.client(Authorization=bearer, Origin="https://evil.test") as http:
        origin = await http.get("/api/overview")
    async with proxy.client(Authorization=bearer) as http:
        host = await http.get("/api/overview", headers={"Host": "evil.test"})
    assert origin.status_code == 403 and "origin" in origin.json()["detail"]
    assert host.status_code == 400 and "host" in host.json()["detail"]
    ws = proxy.url.replace("https://", "wss://") + "/telephony/twilio"
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(ws, origin="https://evil.test"):
            pass
    assert refused.value.response.status_code == 403


# ---- routing, against two stub processes that say who answered --------------------------------

class _Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # nginx keeps its upstream connections open

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"process": self.server.name,
                           "client": self.headers.get("X-Forwarded-For")}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = _answer

    def log_message(self, *_args) -> None:
        pass


@contextmanager
def _stubs() -> Iterator[tuple[int, int]]:
    servers = []
    for name in ("a", "b"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
        server.name = name
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        yield tuple(s.server_address[1] for s in servers)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture(scope="module")
def routing(tmp_path_factory) -> Iterator[Proxy]:
    with _stubs() as ports, Front(tmp_path_factory.mktemp("routing")).running(ports) as proxy:
        yield proxy


def _from(proxy: Proxy, address: str) -> httpx.Client:
    """A client whose connections come from `address` (any 127.x.y.z is loopback)."""
    transport = httpx.HTTPTransport(verify=proxy.tls, local_address=address)
    return httpx.Client(base_url=proxy.url, transport=transport, headers={"Host": proxy.host})


def test_webrtc_signalling_from_one_client_stays_on_one_process(routing):
    chosen = {}
    for i in range(2, 18):
        with _from(routing, f"127.0.0.{i}") as http:
            # The offer, then trickled candidates and a renegotiation for its pc_id.
            answers = [http.post("/api/offer", json={"type": "offer"}),
                       *(http.patch("/api/offer", json={"pc_id": "x"}) for _ in range(3)),
                       http.post("/api/offer", json={"type": "offer", "pc_id": "x"})]
        processes = {a.json()["process"] for a in answers}
        assert len(processes) == 1, f"127.0.0.{i}: signalling split over {processes}"
        chosen[i] = processes.pop()
    assert set(chosen.values()) == {"a", "b"}, "every client went to one process"


def test_other_requests_spread_over_the_processes(routing):
    with _from(routing, "127.0.0.2") as http:
        processes = {http.get("/healthz").json()["process"] for _ in range(6)}
    assert processes == {"a", "b"}


def test_the_process_sees_the_callers_address_not_a_forged_one(routing):
    with _from(routing, "127.0.0.9") as http:
        r = http.get("/api/calls", headers={"X-Forwarded-For": "203.0.113.7"})
    assert r.json()["client"] == "127.0.0.9"
