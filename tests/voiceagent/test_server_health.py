"""`serve`'s health when the LLM engine's worker thread dies: /healthz and /metrics say so."""

from __future__ import annotations

import asyncio
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.voiceagent.serving import server_config
from tests.voiceagent.tiny_shared import tiny_shared
from voiceagent.server.app import create_app


def _worker_up(metrics_text: str) -> float:
    samples = {s.name: s.value for family in text_string_to_metric_families(metrics_text)
               for s in family.samples}
    return samples["voiceagent_engine_worker_up"]


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
            failed = await asyncio.wait_for(shared.engine.generate(prompt), 5)
            health = await http.get("/healthz")
            up = _worker_up((await http.get("/metrics")).text)
    finally:
        shared.close()
    assert failed.finish_reason == "error"
    assert health.status_code == 503
    assert health.json() == {"status": "unhealthy",
                             "error": "LLM engine worker died: SystemExit: exit called mid-forward"}
    assert up == 0
