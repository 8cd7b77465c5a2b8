"""Admission by measured load (`voiceagent.server.admission`): a new call is taken while the
recent turns predict every call's clock 3 within the target; refused with the busy code beyond it,
the calls in progress untouched."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.voiceagent.serving import server_config
from tests.voiceagent.tiny_shared import tiny_shared
from tests.voiceagent.turns import make_turn
from voiceagent.server.admission import WINDOW_S, Admission
from voiceagent.server.app import create_app


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_turn_measured_with_one_call_predicts_twice_its_wait_with_two():
    admission = Admission(1500, lambda: 1, Clock())
    admission.record(700, 1)
    assert admission.predicted_p95_ms(2) == pytest.approx(1400)
    assert admission.refusal(1) is None
    admission.record(900, 1)  # now 1800 ms predicted at the p95
    assert "would wait" in admission.refusal(1)
    assert admission.refusal(0) is None  # an idle process always takes a call


def test_the_hangover_and_a_tools_run_are_not_scaled_with_the_load():
    admission = Admission(1500, lambda: 1, Clock())
    admission.record(1000, 1, fixed_ms=300)  # 300 ms of hangover: the same with two calls
    assert admission.predicted_p95_ms(2) == pytest.approx(300 + 700 * 2)


def test_the_hard_cap_is_part_of_the_headroom():
    admission = Admission(1500, lambda: 1, Clock())
    assert admission.headroom(0, 4)["admits"] and not admission.headroom(4, 4)["admits"]


def test_turns_older_than_the_window_no_longer_refuse_a_call():
    clock = Clock()
    admission = Admission(1500, lambda: 1, clock)
    admission.record(1000, 1)
    assert admission.refusal(1) is not None
    clock.now = WINDOW_S + 1
    assert admission.refusal(1) is None


def test_a_target_of_zero_admits_up_to_max_calls():
    admission = Admission(0, lambda: 1, Clock())
    admission.record(5000, 1)
    assert admission.refusal(3) is None


async def test_a_call_the_load_cannot_take_is_refused_and_the_one_in_progress_is_untouched(
        tmp_path):
    shared = tiny_shared(threading.Event())
    app = create_app(server_config(tmp_path, "server.admit_clock3_ms=1500"), shared)
    state = app.state.server
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://127.0.0.1") as http:
            first = state.calls.reserve("twilio")
            state.records.add(make_turn(call_id=first.call_id, clock3_ms=1000.0))  # slow
            health = (await http.get("/healthz")).json()  # 300 ms hangover + 700 x 2
            offer = await http.post("/api/offer", json={"sdp": "v=0", "type": "offer"})
            metrics = (await http.get("/metrics")).text
    finally:
        shared.close()
    assert offer.status_code == 503 and "would wait 1700 ms" in offer.json()["detail"]
    assert offer.headers["retry-after"]
    assert first.call_id in state.calls.active
    assert health["admission"] == {"target_clock3_ms": 1500.0, "next_call_clock3_p95_ms": 1700,
                                   "admits": False}
    assert "voiceagent_next_call_clock3_p95_seconds 1.7" in metrics
