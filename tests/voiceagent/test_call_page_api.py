"""What the call page reads from the server besides the call itself: its ICE servers
(`GET /api/ice`, from `server.ice_servers`) and the per-turn RTVI message's speculation figures
and tool calls."""

from __future__ import annotations

import httpx
import pytest

from tests.voiceagent.serving import server_config
from tests.voiceagent.turns import make_turn
from voiceagent.dashboard.stats import turn_speculation
from voiceagent.pipeline.turn_record import ToolCall
from voiceagent.server.app import create_app
from voiceagent.server.webrtc import _aiortc_ice_servers, ice_servers, turn_message

TURN = {"urls": ["turn:turn.example.org:3478", "turns:turn.example.org:5349"],
        "username": "caller", "credential": "s3cret-turn"}
CONFIGURED = [{"urls": "stun:stun.example.org:3478"}, TURN]
AS_SERVED = [{"urls": ["stun:stun.example.org:3478"]}, TURN]


def _config(tmp_path, *overrides, ice=None):
    cfg = server_config(tmp_path, *overrides)
    if ice is not None:
        cfg.server.ice_servers = ice  # validated, as a config file's would be
    return cfg


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


async def test_no_ice_servers_by_default(tmp_path):
    async with _client(create_app(_config(tmp_path))) as http:
        response = await http.get("/api/ice")
    assert response.status_code == 200 and response.json() == {"ice_servers": []}


async def test_the_configured_ice_servers_are_served_as_rtc_ice_servers(tmp_path):
    cfg = _config(tmp_path, ice=CONFIGURED)
    async with _client(create_app(cfg)) as http:
        served = (await http.get("/api/ice")).json()
    assert served == {"ice_servers": AS_SERVED}
    # The server's own peer connections use the same servers (aiortc's RTCIceServer).
    (stun, turn) = _aiortc_ice_servers(ice_servers(cfg))
    assert stun.urls == AS_SERVED[0]["urls"] and stun.username is None
    assert (turn.urls, turn.username, turn.credential) == (
        TURN["urls"], "caller", "s3cret-turn")


async def test_ice_servers_need_the_token_as_the_offer_does(tmp_path):
    """A TURN server's credential is in the answer: only callers with the token get it."""
    app = create_app(_config(tmp_path, "server.token=tok", ice=CONFIGURED))
    async with _client(app) as http:
        refused = await http.get("/api/ice")
        bearer = await http.get("/api/ice", headers={"Authorization": "Bearer tok"})
        assert (await http.post("/api/session", json={"token": "tok"})).status_code == 204
        cookie = await http.get("/api/ice")
    assert refused.status_code == 401 and "s3cret-turn" not in refused.text
    assert bearer.json() == cookie.json() == {"ice_servers": AS_SERVED}


def test_the_turn_message_carries_the_speculation_figures_and_tool_calls():
    record = make_turn("c1", 3)
    record.engine.token_times_ms = [0.0] + [1000 / 41.5 * n for n in range(1, 12)]
    record.engine.generated_tokens = 12
    record.tool_calls = [ToolCall("lookup_order", 612.5, 87, ok=True),
                         ToolCall("get_weather", 300.0, None, ok=False, cancelled=True)]
    message = turn_message(record)
    assert message["type"] == "turn" and message["turn"] == 3
    spec = turn_speculation(record.engine)  # the dashboard's per-turn figures
    assert message["speculation"] == {"method": "ngram", "accepted_per_step":
                                      spec["accepted_per_step"],
                                      "acceptance_rate": spec["acceptance_rate"],
                                      "tokens_per_s": pytest.approx(41.5),
                                      "generated_tokens": 12}
    assert message["tool_calls"] == [
        {"name": "lookup_order", "duration_ms": 612.5, "ok": True, "outcome": "ok"},
        {"name": "get_weather", "duration_ms": 300.0, "ok": False, "outcome": "cancelled"}]


def test_a_turn_without_engine_stats_has_empty_figures():
    record = make_turn("c1", 1)
    record.engine = None
    message = turn_message(record)
    assert message["speculation"] == dict.fromkeys(
        ("method", "accepted_per_step", "acceptance_rate", "tokens_per_s",
         "generated_tokens"))
    assert message["tool_calls"] == []
