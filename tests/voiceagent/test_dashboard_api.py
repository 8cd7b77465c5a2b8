"""The dashboard's JSON APIs, live events and /metrics, against the app with a filled store."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_engine.stats import StepStats
from tests.audio.speech import speech
from tests.voiceagent.serving import server_config, serving, twilio_url, until
from tests.voiceagent.turns import make_turn
from voiceagent.dashboard.stats import overview, speculation
from voiceagent.pipeline.records import CallInfo
from voiceagent.pipeline.turn_record import (
    Breakdown,
    Preparation,
    ToolCall,
    TurnRecord,
    TurnStats,
)
from voiceagent.server.app import create_app
from voiceagent.sim.twilio_caller import TwilioCaller


def _app(tmp_path, *overrides):
    return create_app(server_config(tmp_path, *overrides))  # no lifespan: no model loading


def _client(app, **kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                             **kw)


def _fill(app, calls: int = 5, turns: int = 2) -> list:
    server = app.state.server
    records = []
    for c in range(calls):
        call_id = f"call{c}"
        server.store.start_call(CallInfo(call_id, "twilio", 1000.0 + 100 * c, "ngram"))
        for t in range(1, turns + 1):
            record = make_turn(call_id, t, 1000.0 + 100 * c + t, method=("off", "ngram")[c % 2],
                               clock3_ms=800.0 + 10 * c + t, interrupted=(c == 0 and t == 1))
            server.records.add(record)
            records.append(record)
    server.store.flush()
    return records


async def test_overview_is_the_stats_of_the_stored_turns(tmp_path):
    app = _app(tmp_path)
    records = _fill(app)
    async with _client(app) as http:
        got = (await http.get("/api/overview")).json()
        recent = (await http.get("/api/overview", params={"since": 1300})).json()
    expected = json.loads(json.dumps(overview([r.to_dict() for r in records])))  # as JSON
    assert got == {"since": None, "method": None, "config_hash": None, "ab_off_share": 0.1,
                   **expected}
    assert set(got["by_method"]) == {"off", "ngram"}
    assert recent["turns"] == 4 and recent["calls"] == 2


async def test_calls_are_paged_newest_first_without_gaps(tmp_path):
    app = _app(tmp_path)
    _fill(app)
    seen, before = [], None
    async with _client(app) as http:
        for _ in range(5):
            params = {"limit": 2, **({"before": before} if before is not None else {})}
            page = (await http.get("/api/calls", params=params)).json()
            seen += [c["call_id"] for c in page["calls"]]
            before = page["next_before"]
            if before is None:
                break
    assert seen == [f"call{c}" for c in range(4, -1, -1)]


async def test_a_call_has_all_its_turns_and_an_unknown_id_is_404(tmp_path):
    app = _app(tmp_path)
    records = _fill(app)
    async with _client(app) as http:
        found = (await http.get("/api/calls/call1")).json()
        missing = await http.get("/api/calls/nope")
    assert found["turns"] == [r.to_dict() for r in records if r.call_id == "call1"]
    assert found["call"]["kind"] == "twilio"
    assert missing.status_code == 404 and "nope" in missing.json()["detail"]


@pytest.mark.parametrize("path,params", [
    ("/api/calls", {"limit": 0}), ("/api/calls", {"limit": 501}), ("/api/calls", {"limit": "x"}),
    ("/api/overview", {"since": -1}), ("/api/turns", {"limit": 10001}),
    ("/api/calls", {"before": "yesterday"}),
])
async def test_bad_parameters_are_422_with_a_reason(tmp_path, path, params):
    async with _client(_app(tmp_path)) as http:
        response = await http.get(path, params=params)
    assert response.status_code == 422
    assert response.json()["detail"][0]["msg"]


async def test_the_dashboard_apis_need_the_token_when_set(tmp_path):
    app = _app(tmp_path, "server.token=s3cret")
    async with _client(app) as http:
        for path in ("/api/overview", "/api/calls", "/metrics", "/api/events", "/api/turns"):
            assert (await http.get(path)).status_code == 401, path
        assert (await http.get("/dashboard")).status_code == 200  # no data: it asks for one
        # Never from a URL: URLs end up in access logs and browser history.
        assert (await http.get("/api/calls", params={"token": "s3cret"})).status_code == 401
        ok = await http.get("/api/overview", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


async def test_the_page_and_its_charting_library_are_served_locally(tmp_path):
    async with _client(_app(tmp_path)) as http:
        page = await http.get("/dashboard")
        plotly = await http.get("/static/vendor/plotly.min.js")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert plotly.status_code == 200 and len(plotly.content) > 1_000_000


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_metrics_parse_and_count_the_turns_added(tmp_path):
    app = _app(tmp_path)
    records = _fill(app, calls=3, turns=2)
    async with _client(app) as http:
        samples = _samples((await http.get("/metrics")).text)
    assert samples[("voiceagent_turns_total", (("method", "off"),))] == 4
    assert samples[("voiceagent_turns_total", (("method", "ngram"),))] == 2
    assert samples[("voiceagent_interruptions_total", (("method", "off"),))] == 1
    clock3 = samples[("voiceagent_turn_end_to_first_audio_seconds_count", (("method", "off"),))]
    assert clock3 == 4
    drafted = sum(v for (name, labels), v in samples.items()
                  if name == "voiceagent_drafted_tokens_total")
    assert drafted == sum(sum(r.engine.drafted_by_pos) for r in records)
    assert samples[("voiceagent_active_calls", ())] == 0


@pytest.mark.slow
async def test_a_real_call_is_counted_stored_and_streamed_live(tmp_path, models):
    async with serving(server_config(tmp_path), models) as (app, base):
        async with httpx.AsyncClient(base_url=base, timeout=None) as http:
            events: list[str] = []
            subscribed = asyncio.Event()

            async def listen():
                async with http.stream("GET", "/api/events") as stream:
                    async for line in stream.aiter_lines():
                        subscribed.set()  # the stream opens with a comment line
                        if line.startswith("event: "):
                            events.append(line[7:])

            listener = asyncio.create_task(listen())
            await asyncio.wait_for(subscribed.wait(), 10)
            async with TwilioCaller(twilio_url(base)) as caller:
                await caller.start()
                said = await caller.say(speech("What is the capital of France?"))
                assert await caller.reply(said.ended, 45) is not None
                await caller.hang_up()
            for _ in range(100):
                if "turn" in events and events.count("call") >= 2:
                    break
                await asyncio.sleep(0.1)
            listener.cancel()
            app.state.server.store.flush()
            samples = _samples((await http.get("/metrics")).text)
            calls = (await http.get("/api/calls")).json()["calls"]
        turns_run = sum(len(t) for t in app.state.server.records.by_call.values())
    assert turns_run >= 1
    assert samples[("voiceagent_turns_total", (("method", "ngram"),))] == turns_run
    assert [c["turns"] for c in calls] == [turns_run] and calls[0]["ended_at"] is not None
    assert "turn" in events and events.count("call") == 2  # started, ended


async def test_metrics_count_prepared_replies_by_outcome_and_their_waste(tmp_path):
    app = _app(tmp_path)
    committed, hesitant = make_turn("c1", 1), make_turn("c1", 2)
    committed.preparation = Preparation(prepared=1, committed=True)
    hesitant.preparation = Preparation(prepared=3, committed=True, discarded=2,
                                       discarded_tokens=17)
    for record in (committed, hesitant):
        app.state.server.records.add(record)
    async with _client(app) as http:
        samples = _samples((await http.get("/metrics")).text)
    outcome = lambda o: samples[("voiceagent_prepared_replies_total",  # noqa: E731
                                 (("method", "ngram"), ("outcome", o)))]
    assert (outcome("committed"), outcome("discarded")) == (2, 2)
    assert samples[("voiceagent_discarded_tokens_total", (("method", "ngram"),))] == 17


def _tool_turn(call_id: str, turn: int) -> TurnRecord:
    record = make_turn(call_id, turn)
    record.breakdown = Breakdown(user_speech_ms=1500.0, transcript_to_request_ms=1.0,
                                 tool_call_ms=180.0, tools_ms=640.0, first_token_ms=95.0)
    record.tool_calls = [ToolCall("lookup_order", 612.5, 87, ok=True),
                         ToolCall("lookup_order", 2500.0, 41, ok=False),
                         ToolCall("get_weather", 300.0, None, ok=False, cancelled=True)]
    return record


async def test_a_call_shows_its_turns_tool_calls_and_reads_turns_from_before_them(tmp_path):
    app = _app(tmp_path)
    server = app.state.server
    server.records.add(_tool_turn("c1", 1))
    old = make_turn("c1", 2).to_dict()
    del old["tool_calls"], old["breakdown"]["tools_ms"]  # stored before tool calls were
    server.store.write(TurnRecord.from_dict(old))
    server.store.flush()
    async with _client(app) as http:
        turns = (await http.get("/api/calls/c1")).json()["turns"]
    first, second = (TurnRecord.from_dict(t) for t in turns)
    assert [(c.name, c.duration_ms, c.result_chars, c.outcome) for c in first.tool_calls] == [
        ("lookup_order", 612.5, 87, "ok"), ("lookup_order", 2500.0, 41, "error"),
        ("get_weather", 300.0, None, "cancelled")]
    assert (first.breakdown.tool_call_ms, first.breakdown.tools_ms) == (180.0, 640.0)
    assert second.tool_calls == [] and second.breakdown.tools_ms is None
    assert TurnRecord.from_dict(old).tool_calls == []


async def test_metrics_count_tool_calls_by_tool_and_outcome_and_time_them(tmp_path):
    app = _app(tmp_path)
    for turn in (1, 2):
        app.state.server.records.add(_tool_turn("c1", turn))
    async with _client(app) as http:
        samples = _samples((await http.get("/metrics")).text)
    calls = {labels: v for (name, labels), v in samples.items()
             if name == "voiceagent_tool_calls_total"}
    assert calls == {(("outcome", "ok"), ("tool", "lookup_order")): 2,
                     (("outcome", "error"), ("tool", "lookup_order")): 2,
                     (("outcome", "cancelled"), ("tool", "get_weather")): 2}
    seconds = ("voiceagent_tool_call_seconds_sum", (("tool", "lookup_order"),))
    assert samples[seconds] == pytest.approx(2 * (0.6125 + 2.5))
    assert samples[("voiceagent_tool_call_seconds_count", (("tool", "lookup_order"),))] == 4
    assert ("voiceagent_tool_call_seconds_count", (("tool", "get_weather"),)) not in samples


def _fill_configs(app) -> list:
    """Four calls: even ones under config "aaa" with speculation off, odd ones under "bbb" with
    ngram; two turns each."""
    server = app.state.server
    records = []
    for c in range(4):
        call_id, method = f"call{c}", ("off", "ngram")[c % 2]
        server.store.start_call(CallInfo(call_id, "twilio", 1000.0 + 100 * c, method,
                                         ("aaa", "bbb")[c % 2]))
        for t in (1, 2):
            record = make_turn(call_id, t, 1000.0 + 100 * c + t, method=method,
                               clock3_ms=800.0 + 10 * c + t)
            server.records.add(record)
            records.append(record)
    server.store.flush()
    return records


def _as_json(x):
    return json.loads(json.dumps(x))


async def test_filters_by_method_and_config_hash_narrow_every_view(tmp_path):
    app = _app(tmp_path)
    records = _fill_configs(app)
    dicts = [r.to_dict() for r in records]
    of = lambda pred: [d for d in dicts if pred(d)]  # noqa: E731
    off = of(lambda d: d["engine"]["method"] == "off")
    under_bbb = of(lambda d: d["call_id"] in ("call1", "call3"))
    async with _client(app) as http:
        async def get(path, **params):
            response = await http.get(path, params=params)
            assert response.status_code == 200, response.text
            return response.json()

        assert (await get("/api/turns", method="off"))["turns"] == off
        assert (await get("/api/turns", config_hash="bbb"))["turns"] == under_bbb
        assert (await get("/api/turns", config_hash="bbb", limit=3))["turns"] == under_bbb[-3:]
        assert (await get("/api/turns", method="off", config_hash="bbb"))["turns"] == []
        recent = await get("/api/turns", since=1150, config_hash="aaa")
        assert [t["call_id"] for t in recent["turns"]] == ["call2", "call2"]
        ov = await get("/api/overview", method="ngram", config_hash="bbb")
        assert ov == {"since": None, "method": "ngram", "config_hash": "bbb",
                      "ab_off_share": 0.1, **_as_json(overview(under_bbb))}
        assert ov["turns"] == 4 and set(ov["by_method"]) == {"ngram"}
        assert (await get("/api/speculation", config_hash="aaa")) == _as_json(speculation(off))
        assert (await get("/api/overview", config_hash="nope"))["turns"] == 0

        calls = await get("/api/calls", config_hash="aaa", limit=1)
        assert [c["call_id"] for c in calls["calls"]] == ["call2"]
        older = await get("/api/calls", config_hash="aaa", limit=1, before=calls["next_before"])
        assert [c["call_id"] for c in older["calls"]] == ["call0"]
        assert older["next_before"] is None
        assert [c["call_id"] for c in (await get("/api/calls", method="ngram"))["calls"]] == [
            "call3", "call1"]

        choices = await get("/api/filters")
        recent_choices = await get("/api/filters", since=1150)
    assert choices["methods"] == [{"method": "off", "turns": 4}, {"method": "ngram", "turns": 4}]
    assert choices["config_hashes"] == [{"config_hash": "aaa", "turns": 4, "calls": 2},
                                        {"config_hash": "bbb", "turns": 4, "calls": 2}]
    assert recent_choices["config_hashes"] == [{"config_hash": "aaa", "turns": 2, "calls": 1},
                                               {"config_hash": "bbb", "turns": 2, "calls": 1}]


@pytest.mark.parametrize("params", [{"method": ""}, {"config_hash": ""}, {"method": "x" * 65}])
async def test_empty_or_overlong_filters_are_422(tmp_path, params):
    async with _client(_app(tmp_path)) as http:
        for path in ("/api/overview", "/api/turns", "/api/calls"):
            assert (await http.get(path, params=params)).status_code == 422, path


async def test_the_filters_need_the_token_when_set(tmp_path):
    async with _client(_app(tmp_path, "server.token=s3cret")) as http:
        assert (await http.get("/api/filters")).status_code == 401


async def test_overview_says_how_many_turns_each_figure_is_over(tmp_path):
    app = _app(tmp_path)
    _fill(app, calls=2, turns=2)  # call0 off, call1 ngram; call0's first turn interrupted
    server = app.state.server
    unmeasured = make_turn("call9", 1, 2000.0)
    unmeasured.clocks.turn_end_to_first_audio_ms = None
    unmeasured.engine = TurnStats(method="ngram")  # no ITL, no acceptance
    server.records.add(unmeasured)
    server.store.flush()
    async with _client(app) as http:
        ov = (await http.get("/api/overview")).json()
    assert ov["samples"] == {"turn_end_to_first_audio_ms": 4, "request_to_first_token_ms": 5,
                             "itl_turns": 4, "itl_gaps": 12, "speculative_steps": 4,
                             "accepted_per_step_turns": 2, "barge_in_to_silence_ms": 1}
    assert ov["by_method"]["off"]["samples"]["itl_turns"] == 2
    assert ov["by_method"]["ngram"]["samples"] == {
        "turn_end_to_first_audio_ms": 2, "request_to_first_token_ms": 3, "itl_turns": 2,
        "itl_gaps": 6, "speculative_steps": 4, "accepted_per_step_turns": 2,
        "barge_in_to_silence_ms": 0}


async def test_a_call_is_listed_under_its_turns_methods_too(tmp_path):
    """A call of method ngram whose tool turn was decoded as grammar+ngram is a call of both."""
    app = _app(tmp_path)
    server = app.state.server
    server.store.start_call(CallInfo("tools", "webrtc", 1000.0, "ngram", "aaa"))
    server.records.add(make_turn("tools", 1, 1001.0, method="grammar+ngram"))
    server.records.add(make_turn("tools", 2, 1002.0, method="ngram"))
    server.store.start_call(CallInfo("plain", "webrtc", 1100.0, "ngram", "aaa"))
    server.records.add(make_turn("plain", 1, 1101.0, method="ngram"))
    server.store.flush()
    async with _client(app) as http:
        async def listed(**params) -> list[str]:
            return [c["call_id"] for c in (await http.get("/api/calls", params=params)).json()[
                "calls"]]

        assert await listed(method="grammar+ngram") == ["tools"]
        assert await listed(method="ngram") == ["plain", "tools"]
        assert await listed(method="grammar+ngram", config_hash="bbb") == []
        turns = (await http.get("/api/turns", params={"method": "grammar+ngram"})).json()
    assert [(t["call_id"], t["turn"]) for t in turns["turns"]] == [("tools", 1)]


def _step(k: int, drafted: int, accepted: int) -> StepStats:
    return StepStats(k=k, drafted=drafted, accepted=accepted,
                     rejection_pos=None if accepted == drafted else accepted,
                     committed=accepted + 1, draft_ms=0.5, verify_ms=60.0)


async def test_a_call_has_each_turns_speculation_figures(tmp_path):
    """Per turn: speculative steps of all steps, accepted tokens per speculative step, acceptance
    and the K asked for. A plain step (K 0, the gate closed) and an n-gram miss (K 3, nothing
    drafted) are steps, not speculative ones."""
    app = _app(tmp_path)
    server = app.state.server
    server.store.start_call(CallInfo("c1", "twilio", 1000.0, "ngram"))
    spec, off = make_turn("c1", 1, 1001.0), make_turn("c1", 2, 1002.0, method="off")
    steps = [_step(4, 4, 2), _step(0, 0, 0), _step(3, 0, 0), _step(3, 3, 3)]
    spec.engine.steps, spec.engine.k_history = steps, [s.k for s in steps]
    off.engine.steps, off.engine.k_history = [_step(0, 0, 0)] * 5, [0] * 5
    for record in (spec, off):
        server.records.add(record)
    server.store.flush()
    async with _client(app) as http:
        found = (await http.get("/api/calls/c1")).json()
    assert found["speculation"] == [
        {"turn": 1, "method": "ngram", "steps": 4, "speculative_steps": 2, "drafted": 7,
         "accepted": 5, "accepted_per_step": 2.5, "acceptance_rate": 5 / 7, "k_min": 3,
         "k_max": 4, "k_mean": 10 / 3},
        {"turn": 2, "method": "off", "steps": 5, "speculative_steps": 0, "drafted": 0,
         "accepted": 0, "accepted_per_step": None, "acceptance_rate": None, "k_min": None,
         "k_max": None, "k_mean": None},
    ]


@pytest.mark.slow
async def test_a_twilio_call_is_listed_and_shown_with_its_call_sid(tmp_path, models):
    async with serving(server_config(tmp_path), models) as (app, base):
        async with TwilioCaller(twilio_url(base)) as caller:
            await caller.start()  # silence only: the call starts and is stored
            await asyncio.sleep(0.5)
            await caller.hang_up()
        assert await until(lambda: not app.state.server.calls.active, 15)
        app.state.server.store.flush()
        async with httpx.AsyncClient(base_url=base) as http:
            [listed] = (await http.get("/api/calls")).json()["calls"]
            found = (await http.get(f"/api/calls/{listed['call_id']}")).json()
    assert caller.call_sid.startswith("CA")
    assert (listed["kind"], listed["call_sid"]) == ("twilio", caller.call_sid)
    assert found["call"]["call_sid"] == caller.call_sid
