"""One definition per figure: turns whose per-turn values differ from the pooled ones, and every
surface (the dashboard's APIs, /metrics, `voiceagent report`, the call page's turn message) must
show the pooled figure, recomputed here from the raw records of /api/turns."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_engine.stats import StepStats
from tests.audio.speech import speech
from tests.voiceagent.serving import server_config, serving, twilio_url
from tests.voiceagent.turns import make_turn
from voiceagent.cli import main
from voiceagent.dashboard.stats import method_of
from voiceagent.pipeline.turn_record import Percentiles, TurnStats
from voiceagent.server.app import create_app
from voiceagent.server.webrtc import turn_message
from voiceagent.sim.twilio_caller import TwilioCaller


def _stats(method: str, steps: list[tuple[int, int]], itl: list[float]) -> TurnStats:
    """Engine stats with steps of (drafted, accepted); drafted 0 is a plain step."""
    stats = TurnStats(method=method, itl_ms=list(itl))
    for drafted, accepted in steps:
        stats.record_step(StepStats(
            k=drafted, drafted=drafted, accepted=accepted,
            rejection_pos=accepted if accepted < drafted else None, committed=accepted + 1,
            draft_ms=0.2, verify_ms=30.0))
    return stats


# Turn 1: one speculative step accepting 3 among nine plain steps (per turn: 3.0). Turn 2: four
# speculative steps accepting 1 each (per turn: 1.0). Pooled: 7 accepted / 5 steps = 1.4, where
# the mean of the per-turn values would say 2.0.
NGRAM = [([(4, 3)] + [(0, 0)] * 9, [0.0, 0.0, 0.0, 40.0] + [30.0] * 9),
         ([(4, 1)] * 4, [0.0, 35.0, 0.0, 36.0, 0.0, 34.0, 0.0])]
OFF = [([(0, 0)] * 6, [45.0] * 5), ([(0, 0)] * 3, [50.0] * 2)]
POOLED_ACCEPTED = 7 / 5


def _add(server, call_id: str, method: str, turns) -> list:
    records = []
    for n, (steps, itl) in enumerate(turns, 1):
        record = make_turn(call_id, n, 1000.0 + n, method=method)
        record.engine = _stats(method, steps, itl)
        record.clocks.itl_ms = Percentiles.of(itl)
        server.records.add(record)
        records.append(record)
    return records


@pytest.fixture
def app(tmp_path):
    app = create_app(server_config(tmp_path))  # no lifespan: no model loading
    server = app.state.server
    app.state.records = _add(server, "spec", "ngram", NGRAM) + _add(server, "base", "off", OFF)
    server.store.flush()
    return app


async def _get(app, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://127.0.0.1") as http:
        return await http.get(path)


def _recomputed(turns: list[dict], method: str) -> dict:
    """The figures from the raw records, by their definitions."""
    mine = [t for t in turns if method_of(t) == method]
    steps = [s for t in mine for s in t["engine"].get("steps") or [] if s["drafted"]]
    gaps = [g for t in mine for g in t["engine"].get("itl_ms") or []]
    return {"accepted_per_step": sum(s["accepted"] for s in steps) / len(steps) if steps else None,
            "itl_mean": sum(gaps) / len(gaps) if gaps else None}


async def test_accepted_per_step_is_pooled_over_steps_on_every_surface(app, tmp_path):
    turns = (await _get(app, "/api/turns")).json()["turns"]
    want = _recomputed(turns, "ngram")["accepted_per_step"]
    assert want == pytest.approx(POOLED_ACCEPTED)
    ov = (await _get(app, "/api/overview")).json()
    assert ov["accepted_per_step"] == pytest.approx(want)
    assert ov["by_method"]["ngram"]["accepted_per_step"] == pytest.approx(want)
    assert ov["accepted_per_step_by_turn"]["p50"] == pytest.approx(2.0)  # apart, per turn
    assert ov["samples"]["speculative_steps"] == 5
    samples = [s for f in text_string_to_metric_families((await _get(app, "/metrics")).text)
               for s in f.samples if s.labels.get("method") == "ngram"]
    accepted = sum(s.value for s in samples if s.name == "voiceagent_accepted_tokens_total")
    [steps] = [s.value for s in samples if s.name == "voiceagent_speculative_steps_total"]
    assert accepted / steps == pytest.approx(want)
    spec = (await _get(app, "/api/calls/spec")).json()["speculation"]
    assert [s["accepted_per_step"] for s in spec] == [3.0, 1.0]
    assert [turn_message(r)["speculation"]["accepted_per_step"]
            for r in app.state.records[:2]] == [3.0, 1.0]
    db = tmp_path / "runs" / "turns.sqlite"
    assert main(["report", "--set", f"store.path={db}", "--since", "1970-01-01",
                 "--out", str(tmp_path / "r.md")]) == 0
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:]
            for line in (tmp_path / "r.md").read_text().splitlines() if line.startswith("| ")}
    assert rows["accepted tokens / speculative step"][2].strip(" |") == f"{want:.2f}"


async def test_the_itl_speed_up_is_off_s_mean_gap_over_the_method_s_on_every_surface(app):
    turns = (await _get(app, "/api/turns")).json()["turns"]
    off, ngram = (_recomputed(turns, m)["itl_mean"] for m in ("off", "ngram"))
    ov = (await _get(app, "/api/overview")).json()
    speedup = ov["by_method"]["ngram"]["itl_speedup"]
    assert speedup["value"] == pytest.approx(off / ngram)
    assert (speedup["turns"], speedup["off_turns"], speedup["gaps"], speedup["off_gaps"]) == (
        2, 2, 20, 7)
    samples = {(s.name, s.labels.get("method")): s.value for f in text_string_to_metric_families(
        (await _get(app, "/metrics")).text) for s in f.samples}

    def mean_gap(method: str) -> float:
        return (samples[("voiceagent_inter_token_seconds_sum", method)]
                / samples[("voiceagent_inter_token_seconds_count", method)])

    assert mean_gap("off") / mean_gap("ngram") == pytest.approx(off / ngram)


@pytest.mark.slow
async def test_a_scripted_call_with_speculation_on_and_off_shows_the_same_figures_everywhere(
        tmp_path, models):
    """Two Twilio calls through a real server, the second held out with speculation off
    (`server.ab_off_share` 0.5), the first with a barge-in: each figure of /api/overview equals
    the same figure recomputed from /api/turns' raw records and from /metrics."""
    cfg = server_config(tmp_path, "server.ab_off_share=0.5", "engine.speculation.method=ngram")
    async with serving(cfg, models) as (app, base):
        for barge_in in (True, False):
            async with TwilioCaller(twilio_url(base)) as caller:
                await caller.start()
                said = await caller.say(speech("Tell me a long story about a brave dragon."))
                assert await caller.wait(lambda r, t=said.ended: r.media_after(t), 45)
                if barge_in:
                    await asyncio.sleep(0.5)
                    stop = await caller.say(speech("Stop, wait a moment please."))
                    assert await caller.wait(
                        lambda r, t=stop.started: any(c >= t for c in r.clears), 10)
                await caller.reply(said.ended, 45)
                await caller.hang_up()
            await app.state.server.calls.wait_idle(10)
        app.state.server.store.flush()
        turns = (await _get(app, "/api/turns")).json()["turns"]
        ov = (await _get(app, "/api/overview")).json()
        metrics = (await _get(app, "/metrics")).text
    assert {method_of(t) for t in turns} >= {"ngram", "off"}
    samples = [s for f in text_string_to_metric_families(metrics) for s in f.samples]

    def metric(name: str, method: str, **labels) -> float:
        return sum(s.value for s in samples if s.name == name and s.labels.get("method") == method
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    for method, figures in ov["by_method"].items():
        mine = [t for t in turns if method_of(t) == method]
        raw = _recomputed(turns, method)
        assert figures["turns"] == len(mine) == metric("voiceagent_turns_total", method)
        assert figures["interrupted"] == sum(t["interrupted"] for t in mine) == metric(
            "voiceagent_interruptions_total", method)
        assert figures["continued"] == sum(t["continues"] for t in mine)
        assert figures["early_ends"] == sum(t["early_ends"] for t in mine)
        assert figures["itl_ms"]["mean"] == pytest.approx(raw["itl_mean"])
        if raw["itl_mean"] is not None:  # a turn no request answered has no engine stats
            assert figures["itl_ms"]["mean"] == pytest.approx(
                1000 * metric("voiceagent_inter_token_seconds_sum", method)
                / metric("voiceagent_inter_token_seconds_count", method))
        steps = metric("voiceagent_speculative_steps_total", method)
        assert figures["samples"]["speculative_steps"] == steps
        if steps:
            assert figures["accepted_per_step"] == pytest.approx(raw["accepted_per_step"])
            assert figures["accepted_per_step"] == pytest.approx(
                metric("voiceagent_accepted_tokens_total", method) / steps)
        barge = [t["barge_in_to_silence_ms"] for t in mine if t["barge_in_to_silence_ms"]]
        assert figures["samples"]["barge_in_to_silence_ms"] == len(barge) == metric(
            "voiceagent_barge_in_seconds_count", method, stage="total")
        clock3 = [c for t in mine if (c := t["clocks"]["turn_end_to_first_audio_ms"]) is not None]
        assert figures["turn_end_to_first_audio_ms"]["p50"] == (
            pytest.approx(np.percentile(clock3, 50)) if clock3 else None)
    speedup = ov["by_method"]["ngram"]["itl_speedup"]["value"]
    assert speedup == pytest.approx(_recomputed(turns, "off")["itl_mean"]
                                    / _recomputed(turns, "ngram")["itl_mean"])
    assert ov["samples"]["barge_in_to_silence_ms"] >= 1
