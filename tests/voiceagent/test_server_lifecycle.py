"""`voiceagent serve` as a process: health while loading, and a clean stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.audio.speech import speech
from tests.voiceagent.server_proc import REPO, free_port
from tests.voiceagent.serving import server_config
from voiceagent.server.app import create_app
from voiceagent.sim.twilio_caller import TwilioCaller

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "How far away is the moon?"]


async def _wait_ready(base: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(int(timeout / 0.25)):
            assert proc.poll() is None, f"serve exited with {proc.returncode}"
            try:
                if (await http.get(f"{base}/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.25)
    raise AssertionError("serve never became healthy")


# After its graceful shutdown uvicorn re-raises the signal, so the exit status is the usual one
# for that signal: SIGTERM's default action, and our CLI's 130 for SIGINT (KeyboardInterrupt).
EXIT_STATUS = {signal.SIGTERM: -signal.SIGTERM, signal.SIGINT: 130}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_ends_the_call_in_progress_and_the_process_exits(tmp_path, sig):
    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "voiceagent.cli", "serve", "--port", str(port),
         "--set", f"paths.runs_dir={tmp_path}"],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        await _wait_ready(base, proc)
        async with TwilioCaller(f"ws://127.0.0.1:{port}/telephony/twilio") as caller:
            await caller.start()
            await asyncio.sleep(0.5)
            proc.send_signal(sig)
            assert await caller.wait(lambda r: r.close_code is not None, 10), "call not ended"
        assert caller.received.close_code == 1012  # uvicorn's "service restart"
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < 15:
            await asyncio.sleep(0.1)
        assert proc.returncode == EXIT_STATUS[sig], log.read_text()[-2000:]
        assert "Application shutdown complete" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_healthz_is_503_while_loading_then_200(tmp_path):
    app = create_app(server_config(tmp_path))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=transport, base_url="http://127.0.0.1") as http:
        first = await http.get("/healthz")
        assert first.status_code == 503 and first.json()["status"] == "loading"
        for _ in range(600):
            if (await http.get("/healthz")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        ready = await http.get("/healthz")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"


async def test_a_call_before_the_models_are_loaded_is_refused_with_a_reason(tmp_path):
    app = create_app(server_config(tmp_path))  # lifespan not run: the models never load
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        offer = await http.post("/api/offer", json={"sdp": "v=0", "type": "offer"})
        assert offer.status_code == 503 and "loading" in offer.json()["detail"]


def _serve(port: int, runs: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "voiceagent.cli", "serve", "--port", str(port),
         "--set", f"paths.runs_dir={runs}"],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )


async def test_after_a_kill_9_mid_call_every_turn_that_ended_is_in_the_store(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    proc = _serve(port, tmp_path, log)
    try:
        await _wait_ready(base, proc)
        async with httpx.AsyncClient(base_url=base, timeout=None) as http, \
                http.stream("GET", "/api/events") as events:
            lines = events.aiter_lines()
            async with TwilioCaller(f"ws://127.0.0.1:{port}/telephony/twilio") as caller:
                await caller.start()
                ended = []
                for question in QUESTIONS:  # each turn is seen live (so journaled) before the next
                    said = await caller.say(speech(question))
                    assert await caller.wait(
                        lambda r, t=said.ended: r.media_after(t) is not None, 90)
                    ended.append(await _next_turn(lines))
                os.kill(proc.pid, signal.SIGKILL)  # mid-call: no shutdown of any kind
                proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    restarted = _serve(port, tmp_path, log)
    try:
        await _wait_ready(base, restarted)
        async with httpx.AsyncClient(base_url=base) as http:
            stored = (await http.get(f"/api/calls/{ended[0]['call_id']}")).json()["turns"]
    finally:
        restarted.terminate()
        restarted.wait(15)
    assert [t["turn"] for t in stored][: len(ended)] == [t["turn"] for t in ended]
    assert [t["user_text"] for t in stored][: len(ended)] == [t["user_text"] for t in ended]


async def _next_turn(lines) -> dict:
    """The data of the next `turn` server-sent event."""
    event = None
    async for line in lines:
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and event == "turn":
            return json.loads(line[6:])
    raise AssertionError("the event stream ended")
