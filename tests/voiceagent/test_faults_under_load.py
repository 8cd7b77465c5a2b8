"""Faults under load: four Twilio calls in progress on the real models while, one after the
other, the engine's worker dies, the turn store's database refuses writes, and the remote LLM
hangs. Every call goes on (each caller hears an answer or the spoken apology after every turn),
no finished turn is lost, and `/healthz` tells each fault and its end.

The call server's LLM is a remote OpenAI-compatible server (a second `serve`'s /v1 on the same
engine, reached through a TCP proxy the test can make hang) with the in-process engine as
`llm.fallback`. The fault table is printed (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import sqlite3

import httpx
import pytest

from llm_engine.config import SamplingConfig
from tests.audio.speech import speech
from tests.voiceagent.serving import server_config, serving, twilio_url
from voiceagent.config import LLMConfig, store_path
from voiceagent.dashboard.store_sqlite import SQLiteTurnStore
from voiceagent.pipeline.builder import SharedModels
from voiceagent.pipeline.failover import FailoverChat
from voiceagent.pipeline.remote_llm import RemoteChat
from voiceagent.sim.twilio_caller import TwilioCaller

pytestmark = pytest.mark.slow

CALLS = 4
QUESTIONS = ["What is the capital of France?", "Tell me a short fact about the moon.",
             "What is two plus two?", "Can you say hello?"]
APOLOGY = "Sorry, I missed that. Could you say it again?"
REPLY_TIMEOUT_S = 90  # four callers on two cores, each reply behind the others'
MODEL = "smollm2-135m-instruct"


class Proxy:
    """A TCP proxy to `upstream`; while `hang` is set it passes no bytes (a server that
    accepts and never answers)."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.hang = False
        self.server: asyncio.Server | None = None
        self.handlers: set[asyncio.Task] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer) -> None:
        self.handlers.add(asyncio.current_task())
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                                 return_exceptions=True)
        finally:
            for w in (writer, up_writer):
                w.close()

    async def _pipe(self, reader, writer) -> None:
        while data := await reader.read(65536):
            if self.hang:
                continue  # lost: a hung server never sees the request, nor the client its reply
            writer.write(data)
            await writer.drain()

    async def close(self) -> None:
        self.server.close()
        for task in self.handlers:
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)


async def _turn(callers: list[TwilioCaller], app) -> dict:
    """Every caller asks at once; how many heard an answer, how many the apology."""
    said = await asyncio.gather(*(c.say(speech(q)) for c, q in zip(callers, QUESTIONS,
                                                                     strict=True)))
    heard = await asyncio.gather(*(
        c.wait(lambda r, t=s.ended: r.media_after(t) is not None and
               any(at >= t for at, _ in r.marks), REPLY_TIMEOUT_S)
        for c, s in zip(callers, said, strict=True)))
    assert sum(heard) == len(callers) or not _closes(callers), _closes(callers)
    await asyncio.sleep(1.0)  # the turns' records reach the store
    records = [r for turns in app.state.server.records.by_call.values() for r in turns]
    last = [max((r for r in records if r.call_id == cid), key=lambda r: r.turn)
            for cid in app.state.server.records.by_call]
    return {"heard": sum(heard), "apologies": sum(r.bot_text.strip() == APOLOGY for r in last)}


async def _all_in_progress(callers: list[TwilioCaller], app, timeout_s: float = 30) -> bool:
    """Whether every caller's call is in progress on the server before the first turn."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(app.state.server.calls.active) < len(callers):
        if _closes(callers) or asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def _closes(callers: list[TwilioCaller]) -> list[str]:
    """How the server closed the callers it closed: code and reason."""
    return [f"caller {i}: {c.received.close_code} {c.received.close_reason}"
            for i, c in enumerate(callers) if c.closed.is_set()]


async def _health(http: httpx.AsyncClient) -> str:
    body = (await http.get("/healthz")).json()
    engine, store = body.get("engine") or {}, body.get("store") or {}
    why = [f"store: {store['last_error']}" if store.get("failing") else "",
           f"llm: {body['llm']['last_error']}" if body.get("llm", {}).get("last_error") else ""]
    return "; ".join([f"{body['status']}, worker restarts {engine.get('worker_restarts')}",
                      *filter(None, why)])


async def test_four_calls_survive_a_dead_worker_a_refusing_store_and_a_hanging_llm(
        tmp_path, own_models, monkeypatch):
    # A locked database refuses a write at once, not after 30 s of waiting for the lock.
    monkeypatch.setattr(SQLiteTurnStore, "busy_timeout_s", 0.05)
    llm_cfg = server_config(tmp_path / "llm", "server.max_api_requests=16")
    async with serving(llm_cfg, own_models) as (_llm_app, llm_base):
        proxy = Proxy(int(llm_base.rsplit(":", 1)[1]))
        port = await proxy.start()
        remote = RemoteChat(LLMConfig(backend="openai", base_url=f"http://127.0.0.1:{port}/v1",
                                      timeout_s=30), MODEL, "remote",
                            SamplingConfig(max_new_tokens=64, temperature=0.0))
        # The primary is tried on every request, so each fault meets it (no breaker); its first
        # token may take over 3 s with four calls on a loaded CI machine, a hang never comes.
        failover = FailoverChat(remote, own_models.chat, first_token_timeout_s=6,
                                retry_primary_s=0)
        shared = SharedModels(llm=own_models.llm, worker=own_models.worker, chat=failover,
                              speech=own_models.speech)
        cfg = server_config(tmp_path / "calls", "llm.backend=openai",
                            f"llm.base_url=http://127.0.0.1:{port}/v1")
        table = []
        try:
            async with serving(cfg, shared) as (app, base), \
                    httpx.AsyncClient(base_url=base) as http:
                # Synthesised before any call starts: Piper on the event loop would stall the
                # server's handshakes (they must see `start` within 5 s) on a loaded machine.
                for question in QUESTIONS:
                    speech(question)
                callers = [TwilioCaller(twilio_url(base)) for _ in range(CALLS)]
                for caller in callers:
                    await caller.__aenter__()
                    await caller.start()
                assert await _all_in_progress(callers, app), _closes(callers)
                table.append(("none", await _turn(callers, app), await _health(http), ""))

                # 1. the engine's worker dies at its next step
                engine = own_models.worker.engine
                step_many = engine.step_many

                def die(states):
                    engine.step_many = step_many
                    raise SystemExit("injected: the worker dies")

                engine.step_many = die
                during = await _turn(callers, app)
                table.append(("engine worker killed", during, await _health(http),
                              own_models.worker.last_death or ""))

                # 2. the store's database refuses writes
                store = app.state.server.store
                lock = sqlite3.connect(store_path(cfg), timeout=1, isolation_level=None)
                lock.execute("BEGIN EXCLUSIVE")
                during = await _turn(callers, app)
                refused = await _health(http)
                lock.rollback()
                lock.close()
                # Off the event loop: the calls' media keep flowing while the store catches up.
                assert await asyncio.to_thread(store.flush, 20)
                table.append(("store refuses writes", during, refused, await _health(http)))

                # 3. the remote LLM hangs
                proxy.hang = True
                during = await _turn(callers, app)
                hung = await _health(http)
                proxy.hang = False
                table.append(("remote LLM hangs", during, hung,
                              f"fallback served {failover.failovers} requests"))
                table.append(("(all faults over)", await _turn(callers, app),
                              await _health(http), ""))

                for caller in callers:
                    await caller.hang_up()
                    await caller.__aexit__(None, None, None)
                await app.state.server.calls.wait_idle(20)
                assert await asyncio.to_thread(store.flush, 20)
                kept = [r for turns in app.state.server.records.by_call.values() for r in turns]
                stored = store.turns()
        finally:
            await proxy.close()
    print("\n| fault | callers who heard a reply | apologies | /healthz | note |")
    for fault, turn, health, note in table:
        print(f"| {fault} | {turn['heard']} of {CALLS} | {turn['apologies']} | {health} | "
              f"{note} |")
    print(f"turns: {len(kept)} recorded, {len(stored)} stored")
    assert all(turn["heard"] == CALLS for _, turn, _, _ in table), table
    assert len(kept) == len(stored) == CALLS * len(table)
    assert own_models.worker.restarts_done >= 1 and own_models.worker.worker_alive
    assert "degraded" in table[2][2] and "store" in table[2][2]  # /healthz told the fault ...
    assert table[2][3].startswith("ready")  # ... and its end
    assert "degraded" in table[3][2] and "no first token" in table[3][2]
    assert table[4][2].startswith("ready")
    assert failover.failovers >= CALLS
