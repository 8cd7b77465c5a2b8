"""`serve`'s health when the LLM engine's worker thread dies: /healthz and /metrics say so, and
a worker with restarts left serves again."""

from __future__ import annotations

import asyncio
import signal
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.llm_engine.tiny_models import break_forward_once
from tests.voiceagent.serving import server_config
from tests.voiceagent.tiny_shared import tiny_shared
from voiceagent.server.app import create_app
from voiceagent.server.serve import DrainingServer, uvicorn_config


def _samples(metrics_text: str) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(metrics_text)
            for s in family.samples}


def _worker_up(metrics_text: str) -> float:
    return _samples(metrics_text)["voiceagent_engine_worker_up"]


async def test_a_dead_llm_worker_restarts_and_healthz_and_metrics_count_it(tmp_path):
    shared = tiny_shared(restarts=2)
    app = create_app(server_config(tmp_path), shared)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://127.0.0.1") as http:
            break_forward_once(shared.llm.target.model, SystemExit("exit called mid-forward"))
            prompt = shared.llm.target.tokenizer.encode("Hello")
            failed = await asyncio.wait_for(shared.worker.generate(prompt), 5)
            for _ in range(250):  # the backoff: 0.5 s
                health = await http.get("/healthz")
                if health.status_code == 200:
                    break
                await asyncio.sleep(0.02)
            served = await asyncio.wait_for(shared.worker.generate(prompt), 10)
            metrics = _samples((await http.get("/metrics")).text)
    finally:
        shared.close()
    assert failed.finish_reason == "error" and served.error is None
    assert health.json()["status"] == "ready"
    assert health.json()["engine"] == {
        "worker_restarts": 1, "last_death": "LLM engine worker died: SystemExit: exit called "
                                            "mid-forward"}
    assert metrics["voiceagent_engine_worker_restarts_total"] == 1
    assert metrics["voiceagent_engine_worker_up"] == 1


async def test_a_dead_llm_worker_makes_healthz_503_and_its_gauge_0(tmp_path):
    go = threading.Event()
    shared = tiny_shared(go)
    app = create_app(server_config(tmp_path), shared)  # no lifespan: the models are given
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://127.0.0.1") as http:
            assert (await http.get("/healthz")).json()["status"] == "ready"
            assert _worker_up((await http.get("/metrics")).text) == 1
            go.set()
            prompt = shared.llm.target.tokenizer.encode("Hello")
            failed = await asyncio.wait_for(shared.worker.generate(prompt), 5)
            health = await http.get("/healthz")
            up = _worker_up((await http.get("/metrics")).text)
    finally:
        shared.close()
    assert failed.finish_reason == "error"
    assert health.status_code == 503
    assert health.json() == {"status": "unhealthy",
                             "error": "LLM engine worker died: SystemExit: exit called mid-forward"}
    assert up == 0


async def test_a_drain_needs_the_token_then_refuses_new_calls_and_stops_the_process(tmp_path):
    shared = tiny_shared(threading.Event())
    app = create_app(server_config(tmp_path, "server.token=drain-token"), shared)
    state = app.state.server
    stopped = asyncio.Event()
    state.request_exit = stopped.set  # what `serve` does: stop uvicorn
    auth = {"Authorization": "Bearer drain-token"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://127.0.0.1") as http:
            assert (await http.post("/admin/drain")).status_code == 401
            assert not state.calls.draining
            call = state.calls.reserve("twilio")  # a call in progress holds the process up
            drained = await http.post("/admin/drain", headers=auth)
            health = await http.get("/healthz")
            offer = await http.post("/api/offer", headers=auth,
                                    json={"sdp": "v=0", "type": "offer"})
            await asyncio.sleep(0.3)
            held = not stopped.is_set()
            state.calls.release(call)  # the call ends: the process stops
            await asyncio.wait_for(stopped.wait(), 5)
    finally:
        shared.close()
    assert drained.status_code == 202 and drained.json()["status"] == "draining"
    assert health.status_code == 503
    assert health.json() == {"status": "draining", "calls": 1}
    assert offer.status_code == 503 and "draining" in offer.json()["detail"]
    assert held


async def test_a_sigterm_during_a_drain_asked_over_http_joins_it_and_a_second_stops(tmp_path):
    shared = tiny_shared(threading.Event())
    app = create_app(server_config(tmp_path), shared)
    server = DrainingServer(uvicorn_config(app, app.state.server.cfg, "127.0.0.1", 0, "warning"),
                            app.state.server)
    server._loop = asyncio.get_running_loop()  # as startup() sets it
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://127.0.0.1") as http:
            app.state.server.calls.reserve("twilio")  # a call holds the drain open
            assert (await http.post("/admin/drain")).status_code == 202
            server.handle_exit(signal.SIGTERM, None)  # systemctl restart: the drain goes on
            await asyncio.sleep(0.05)
            joined = not server.should_exit
            server.handle_exit(signal.SIGTERM, None)  # the operator insists: stop now
    finally:
        shared.close()
    assert joined and server.should_exit
