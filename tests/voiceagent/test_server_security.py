"""Secure defaults: who may reach the server, from where, and what never leaks (the token)."""

from __future__ import annotations

import asyncio
import logging
import socket
import sqlite3

import httpx
import pytest
import websockets

from tests.voiceagent.serving import server_config, serving, twilio_url, until
from tests.voiceagent.tiny_shared import tiny_shared
from tests.voiceagent.turns import make_turn
from voiceagent.cli import main
from voiceagent.server.app import create_app
from voiceagent.server.auth import SESSION_COOKIE
from voiceagent.server.guard import RedactTokens
from voiceagent.server.serve import Exposed, exposure_notes
from voiceagent.sim.twilio_caller import TwilioCaller

LOCAL = "http://127.0.0.1"


def _client(tmp_path, *overrides, base: str = LOCAL) -> httpx.AsyncClient:
    app = create_app(server_config(tmp_path, *overrides))  # no lifespan: no model loading
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base)


@pytest.fixture
async def tiny_server(tmp_path):
    """A real server on a loopback port with a tiny engine: for WebSocket handshakes."""
    shared = tiny_shared()
    started = []

    async def start(*overrides):
        context = serving(server_config(tmp_path, *overrides), shared)
        started.append(context)
        return await context.__aenter__()

    yield start
    for context in reversed(started):
        await context.__aexit__(None, None, None)
    shared.close()


async def test_a_host_name_not_configured_is_refused(tmp_path):
    async with _client(tmp_path) as http:
        ok = await http.get("/healthz")
        rebound = await http.get("/healthz", headers={"Host": "evil.example:7860"})
    assert ok.status_code == 503  # loading: but it answered
    assert rebound.status_code == 400 and "not allowed" in rebound.json()["detail"]


async def test_a_server_without_a_token_refuses_what_a_proxy_forwarded(tmp_path):
    proxied = {"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https"}
    async with _client(tmp_path) as http:
        open_loopback = await http.get("/api/overview", headers=proxied)
        direct = await http.get("/api/overview")
    async with _client(tmp_path, "server.token=s3cret") as http:
        tokened = await http.get("/api/overview", headers=proxied)
    assert open_loopback.status_code == 403 and "no token" in open_loopback.json()["detail"]
    assert direct.status_code == 200
    assert tokened.status_code == 401  # past the guard: the token decides


async def test_a_page_of_another_origin_cannot_call_the_apis(tmp_path):
    async with _client(tmp_path, "server.allowed_origins=[https://ops.example]") as http:
        foreign = await http.get("/api/overview", headers={"Origin": "http://evil.example"})
        same = await http.get("/api/overview", headers={"Origin": "http://127.0.0.1"})
        listed = await http.get("/api/overview", headers={"Origin": "https://ops.example"})
        offer = await http.post("/api/offer", headers={"Origin": "null"}, json={})
    assert foreign.status_code == 403 and "origin" in foreign.json()["detail"]
    assert same.status_code == 200 and listed.status_code == 200
    assert offer.status_code == 403


async def test_a_websocket_from_another_origin_is_refused_at_its_handshake(tiny_server):
    _app, base = await tiny_server()
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(twilio_url(base), origin="http://evil.example"):
            pass
    assert refused.value.response.status_code == 403


async def test_the_token_is_never_read_from_a_url(tmp_path):
    async with _client(tmp_path, "server.token=s3cret") as http:
        in_query = await http.get("/api/overview", params={"token": "s3cret"})
        in_header = await http.get("/api/overview", headers={"Authorization": "Bearer s3cret"})
    assert in_query.status_code == 401 and in_header.status_code == 200


async def test_the_pages_session_cookie_is_httponly_strict_and_not_the_token(tmp_path):
    async with _client(tmp_path, "server.token=s3cret") as http:
        wrong = await http.post("/api/session", json={"token": "guess"})
        right = await http.post("/api/session", json={"token": "s3cret"})
        cookie = right.headers["set-cookie"]
        with_cookie = await http.get("/api/overview")  # the client keeps the cookie
        http.cookies.clear()
        without = await http.get("/api/overview")
    assert wrong.status_code == 401 and right.status_code == 204
    assert cookie.startswith(f"{SESSION_COOKIE}=") and "s3cret" not in cookie
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert with_cookie.status_code == 200 and without.status_code == 401


async def test_sign_in_attempts_are_limited_per_client_address(tmp_path):
    app = create_app(server_config(tmp_path, "server.token=s3cret",
                                   "server.session_attempts_per_min=3"))

    def client(address: str) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=app, client=(address, 4000))
        return httpx.AsyncClient(transport=transport, base_url=LOCAL)

    async with client("203.0.113.7") as guesser, client("203.0.113.8") as other:
        guesses = [await guesser.post("/api/session", json={"token": f"guess{i}"})
                   for i in range(3)]
        limited = await guesser.post("/api/session", json={"token": "s3cret"})
        elsewhere = await other.post("/api/session", json={"token": "s3cret"})
    assert [r.status_code for r in guesses] == [401, 401, 401]
    assert limited.status_code == 429 and 1 <= int(limited.headers["retry-after"]) <= 60
    assert "too many" in limited.json()["detail"]
    assert elsewhere.status_code == 204


async def test_sign_out_ends_the_session_for_every_copy_of_its_cookie(tmp_path):
    app = create_app(server_config(tmp_path, "server.token=s3cret", "server.session_ttl_s=600"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=LOCAL) as http:
        signed_in = await http.post("/api/session", json={"token": "s3cret"})
        copy = {SESSION_COOKIE: http.cookies[SESSION_COOKIE]}
        async with httpx.AsyncClient(transport=transport, base_url=LOCAL, cookies=copy) as other:
            before = await other.get("/api/overview")
            await http.delete("/api/session")
            after = await other.get("/api/overview")
    assert "Max-Age=600" in signed_in.headers["set-cookie"]
    assert before.status_code == 200 and after.status_code == 401


async def test_a_start_whose_token_is_a_lone_surrogate_is_closed_with_1008(tiny_server):
    _app, base = await tiny_server("server.token=s3cret")
    async with TwilioCaller(twilio_url(base), custom_parameters={"token": "\ud800"}) as caller:
        await caller.start(stream=False)  # json.dumps escapes it: valid JSON, invalid UTF-16
        await caller.wait(lambda r: r.close_code is not None, 5)
    assert (caller.received.close_code, caller.received.close_reason) == (
        1008, "unauthorized: missing or wrong token")


@pytest.mark.parametrize("field,value", [("pc_id", []), ("pc_id", {"a": 1}), ("restart_pc", "x")])
async def test_an_offer_with_a_field_of_the_wrong_type_is_400(tmp_path, field, value):
    async with _client(tmp_path) as http:
        response = await http.post("/api/offer", json={"sdp": "v=0", "type": "offer",
                                                       field: value})
    assert response.status_code == 400 and field in response.json()["detail"]


def test_serve_refuses_a_public_address_without_a_token(tmp_path, capsys):
    code = main(["serve", "--host", "0.0.0.0", "--set", f"paths.runs_dir={tmp_path}"])
    assert code == 2
    assert "refusing to serve 0.0.0.0 without server.token" in capsys.readouterr().err


def test_an_insecure_public_server_is_announced_and_a_tokened_one_refuses_unsigned_calls():
    public = server_config("/tmp", "server.host=0.0.0.0")
    with pytest.raises(Exposed):
        exposure_notes(public)
    public.server.allow_public_without_token = True
    assert [n.split(":")[0] for n in exposure_notes(public)] == ["INSECURE", "INSECURE"]
    tokened = server_config("/tmp", "server.host=0.0.0.0", "server.token=t")
    assert exposure_notes(tokened)[0].startswith("Twilio calls are refused")
    assert exposure_notes(server_config("/tmp")) == []  # loopback: nothing to say
    tunnelled = server_config("/tmp", "server.public_url=https://abc.ngrok.app")
    with pytest.raises(Exposed, match="abc.ngrok.app"):  # loopback, but published
        exposure_notes(tunnelled)


async def test_unsigned_twilio_calls_are_refused_off_loopback(tiny_server):
    _app, base = await tiny_server("server.host=0.0.0.0", "server.token=s3cret")
    async with TwilioCaller(twilio_url(base), token="s3cret") as caller:
        await caller.start(stream=False)
        await caller.wait(lambda r: r.close_code is not None, 5)
    assert caller.received.close_code == 1008
    assert "twilio_auth_token" in caller.received.close_reason


def test_the_access_log_never_shows_a_token():
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/api/turns?since=1&token=s3cret", "1.1",
                                200), None)
    RedactTokens().filter(record)
    assert record.getMessage() == '127.0.0.1:5 - "GET /api/turns?since=1&token=*** HTTP/1.1" 200'


async def test_idle_sockets_of_one_client_cannot_take_every_handshake_place(tiny_server):
    """An attacker's sockets that never send `start` fill only its own places; another client
    still gets through (here refused later, for its wrong token: past the handshake limit)."""
    _app, base = await tiny_server("server.token=s3cret", "server.start_timeout_s=2",
                                   "server.max_handshakes_per_client=2")
    url = twilio_url(base)
    attacker = {"X-Forwarded-For": "203.0.113.9"}  # uvicorn trusts it from loopback
    idle = [TwilioCaller(url, headers=attacker) for _ in range(2)]
    for caller in idle:
        await caller.__aenter__()
    async with TwilioCaller(url, headers=attacker) as third:
        await third.wait(lambda r: r.close_code is not None, 5)
    async with TwilioCaller(url, headers={"X-Forwarded-For": "198.51.100.7"},
                            token="wrong") as other:
        await other.start(stream=False)
        await other.wait(lambda r: r.close_code is not None, 5)
    for caller in idle:
        await caller.wait(lambda r: r.close_code is not None, 5)
        await caller.__aexit__(None, None, None)
    assert (third.received.close_code, third.received.close_reason) == (
        1013, "too many connections from this client waiting to start")
    assert other.received.close_reason.startswith("unauthorized")
    assert [c.received.close_reason for c in idle] == ["no start within 2 s"] * 2


async def test_live_event_streams_are_capped_and_a_client_gone_leaves_no_subscriber(tiny_server):
    app, base = await tiny_server("server.max_event_subscribers=2")
    hub = app.state.server.events
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        for _ in range(5):  # clients that go away at once, before reading anything
            async with http.stream("GET", "/api/events"):
                pass
        assert await until(lambda: hub.subscribers == 0, 5)  # none of them left behind
        async with http.stream("GET", "/api/events") as one, \
                http.stream("GET", "/api/events") as two:
            # The readers are kept: one dropped is finalised, and closes its stream, at once.
            readers = [one.aiter_text(), two.aiter_text()]
            firsts = [await anext(r) for r in readers]
            refused = await http.get("/api/events")
            assert hub.subscribers == 2 and all(f.startswith(": live") for f in firsts)
    assert refused.status_code == 503 and "at most 2" in refused.json()["detail"]
    assert await until(lambda: hub.subscribers == 0, 5)


async def test_live_event_streams_opened_together_beyond_the_cap_are_refused_with_503(tiny_server):
    app, base = await tiny_server("server.max_event_subscribers=2")
    host, port = base.removeprefix("http://").split(":")
    request = f"GET /api/events HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    # Three requests written before the server's loop runs again: it reads all three in one go,
    # so no stream of theirs has started when the third is accepted.
    socks = [socket.create_connection((host, int(port))) for _ in range(3)]
    for s in socks:
        s.sendall(request)
    loop = asyncio.get_running_loop()
    try:
        for s in socks:
            s.setblocking(False)
        heads = [await asyncio.wait_for(loop.sock_recv(s, 4096), 10) for s in socks]
        statuses = sorted(int(h.split()[1]) for h in heads)
        subscribed = app.state.server.events.subscribers
    finally:
        for s in socks:
            s.close()
    assert statuses == [200, 200, 503] and subscribed == 2


async def test_healthz_says_degraded_while_the_store_cannot_write(tiny_server):
    app, base = await tiny_server()
    store = app.state.server.store
    store.busy_timeout_s = 0.05
    async with httpx.AsyncClient(base_url=base) as http:
        fine = (await http.get("/healthz")).json()
        with sqlite3.connect(store.path) as other:
            other.execute("BEGIN EXCLUSIVE")  # another process holds the database
            app.state.server.records.add(make_turn("locked-out"))
            assert await until(lambda: store.failing, 5)
            degraded = (await http.get("/healthz")).json()
            metrics = (await http.get("/metrics")).text
            other.rollback()
        assert await asyncio.to_thread(store.flush, 10)
        recovered = (await http.get("/healthz")).json()
    assert fine["status"] == "ready" and fine["store"]["write_errors"] == 0
    assert degraded["status"] == "degraded" and degraded["store"]["write_errors"] >= 1
    assert "database is locked" in degraded["store"]["last_error"]
    assert 'voiceagent_errors_total{kind="store_write"}' in metrics
    assert "voiceagent_store_failing 1.0" in metrics
    assert recovered["status"] == "ready" and [t["call_id"] for t in store.turns()] == [
        "locked-out"]

