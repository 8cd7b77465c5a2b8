"""`voiceagent serve` as a process: health while loading, a drain on SIGTERM, and a clean stop."""

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
import websockets

from tests.audio.speech import speech
from tests.voiceagent.server_proc import READY_TIMEOUT_S, REPO, free_port
from tests.voiceagent.serving import server_config
from voiceagent.server.app import create_app
from voiceagent.sim.twilio_caller import TwilioCaller

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "How far away is the moon?"]


async def _wait_ready(base: str, proc: subprocess.Popen, timeout: float = READY_TIMEOUT_S) -> None:
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


def _serve(port: int, runs: Path, log: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "voiceagent.cli", "serve", "--port", str(port),
         "--set", f"paths.runs_dir={runs}", *overrides],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


async def _exit_status(proc: subprocess.Popen, timeout: float = 15) -> int | None:
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        await asyncio.sleep(0.1)
    return proc.returncode


# After its graceful shutdown uvicorn re-raises the signal, so the exit status is the usual one
# for that signal: SIGTERM's default action, and our CLI's 130 for SIGINT (KeyboardInterrupt).
EXIT_STATUS = {signal.SIGTERM: -signal.SIGTERM, signal.SIGINT: 130}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT],
                         ids=["SIGTERM-without-drain", "SIGINT"])
async def test_a_stop_signal_ends_the_call_in_progress_and_the_process_exits(tmp_path, sig):
    port, log = free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    proc = _serve(port, tmp_path, log, "--set", "server.drain_timeout_s=0")
    try:
        await _wait_ready(base, proc)
        async with TwilioCaller(f"ws://127.0.0.1:{port}/telephony/twilio") as caller:
            await caller.start()
            await asyncio.sleep(0.5)
            proc.send_signal(sig)
            assert await caller.wait(lambda r: r.close_code is not None, 10), "call not ended"
        assert caller.received.close_code == 1012  # uvicorn's "service restart"
        assert await _exit_status(proc) == EXIT_STATUS[sig], log.read_text()[-2000:]
        assert "Application shutdown complete" in log.read_text()
    finally:
        _reap(proc)


async def test_sigterm_drains_the_call_in_progress_refuses_new_ones_then_exits(tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    base, ws = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/telephony/twilio"
    proc = _serve(port, tmp_path, log)
    try:
        await _wait_ready(base, proc)
        async with TwilioCaller(ws) as caller:
            await caller.start()
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            async with httpx.AsyncClient() as http:
                for _ in range(50):  # the drain starts on the event loop
                    health = await http.get(f"{base}/healthz")
                    if health.status_code == 503:
                        break
                    await asyncio.sleep(0.1)
            assert health.status_code == 503
            assert health.json() == {"status": "draining", "calls": 1}
            with pytest.raises(websockets.InvalidStatus) as refused:  # at the upgrade
                async with TwilioCaller(ws):
                    pass
            assert refused.value.response.status_code == 503
            # The call in progress goes on: a question after the SIGTERM is answered.
            said = await caller.say(speech(QUESTIONS[0]))
            assert await caller.wait(lambda r: r.media_after(said.ended) is not None, 60), \
                log.read_text()[-2000:]
            assert caller.received.close_code is None
            assert proc.poll() is None  # still serving it
            await caller.hang_up()
        assert await _exit_status(proc, 30) == 0, log.read_text()[-2000:]
        assert "drained: no call in progress" in log.read_text()
    finally:
        _reap(proc)


async def test_sigterm_while_the_models_load_exits_at_once_without_an_abort(tmp_path):
    # An empty cache: the load de-quantises the GGUF and measures the machine, a minute or more.
    port, log = free_port(), tmp_path / "serve.log"
    proc = _serve(port, tmp_path, log, "--set", f"paths.cache_dir={tmp_path / 'cache'}")
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(240):
                try:
                    health = (await http.get(f"http://127.0.0.1:{port}/healthz")).json()
                    if health.get("step", "starting") != "starting":
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.25)
        assert health["status"] == "loading", health
        await asyncio.sleep(2)  # the loader is running (the abort came when it was in torch)
        proc.send_signal(signal.SIGTERM)
        # It could abort with "terminate called without an active exception" (SIGABRT).
        assert await _exit_status(proc, 30) == 0, log.read_text()[-2000:]
        assert "stopped while loading the models" in log.read_text()
    finally:
        _reap(proc)


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
        _reap(proc)
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
