"""The turn store on a real PostgreSQL server: what only a shared server database brings (an
outage to ride out, several writers and creators at once, a URL with a password, two `serve`
processes on one dashboard). The cases both backends share are in test_store.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import httpx
import psycopg
import pytest

from tests.voiceagent.server_proc import free_port, running_server
from tests.voiceagent.serving import server_config, serving, twilio_url, until
from tests.voiceagent.test_store import opened_at_once
from tests.voiceagent.tiny_shared import tiny_shared
from tests.voiceagent.turns import make_turn
from voiceagent.cli import main
from voiceagent.config import load_config
from voiceagent.dashboard.store import SCHEMA_VERSION, StoreError, open_store
from voiceagent.dashboard.store_postgres import PostgresTurnStore
from voiceagent.sim.twilio_caller import TwilioCaller
from voiceagent.urls import redact

PASSWORD = "hunter2"  # the test server trusts every local connection, so any password will do


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def _with_password(url: str) -> str:
    return url.replace("postgres@", f"postgres:{PASSWORD}@")


def test_the_url_shown_has_no_password():
    assert redact("postgresql://u:p%40ss@db:5432/turns?sslmode=require&password=x") == \
        "postgresql://u:***@db:5432/turns?sslmode=require&password=***"
    assert redact("postgresql://u@db/turns") == "postgresql://u@db/turns"
    assert redact("host=db password='a b' user=u") == "host=db password=*** user=u"


def test_a_url_libpq_cannot_parse_is_refused_without_its_password(tmp_path):
    url = f"postgresql://u:{PASSWORD}@[::1/turns"  # the IPv6 bracket is never closed
    with pytest.raises(StoreError) as refused:
        PostgresTurnStore(url, tmp_path / "postgres")
    message = str(refused.value)
    assert message.startswith("cannot open the turn store postgresql://***@[::1/turns: ")
    assert PASSWORD not in message


def test_store_url_picks_postgres_with_its_journal_in_the_runs_dir(tmp_path, postgres_url):
    cfg = load_config(None, [f"paths.runs_dir={tmp_path}", f"store.url={postgres_url}"])
    store = open_store(cfg)
    assert isinstance(store, PostgresTurnStore)
    assert (tmp_path / f"postgres.journal-{os.getpid()}").exists()
    store.write(make_turn("pg", 1, 1.0))
    assert store.flush()
    store.close()
    with psycopg.connect(postgres_url) as db:
        assert db.execute("SELECT call_id, turn FROM turns").fetchall() == [("pg", 1)]
    assert not (tmp_path / "turns.sqlite").exists()


def test_another_schema_version_is_refused_naming_the_url_without_its_password(
        tmp_path, postgres_url):
    url = _with_password(postgres_url)
    PostgresTurnStore(url, tmp_path / "postgres").close()
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")
    with pytest.raises(StoreError) as refused:
        PostgresTurnStore(url, tmp_path / "postgres")
    message = str(refused.value)
    assert f"turn store {redact(url)} has schema version 7" in message
    assert f"reads version {SCHEMA_VERSION}" in message and PASSWORD not in message


def test_serve_with_an_unreachable_store_url_fails_in_one_line_without_the_password(
        capsys, tmp_path):
    url = f"postgresql://postgres:{PASSWORD}@127.0.0.1:{free_port()}/turns"  # nobody listens
    assert main(["serve", "--set", f"store.url={url}", "--set", f"paths.runs_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err  # pipecat's import banner may come first
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot open the turn store {redact(url)}: ")
    assert "Connection refused" in last
    assert "Traceback" not in err and PASSWORD not in err


def test_report_reads_the_postgres_store_and_names_it_without_the_password(
        tmp_path, postgres_url):
    url = _with_password(postgres_url)
    store = PostgresTurnStore(url, tmp_path / "postgres")
    store.write(make_turn("r", 1, time.time()))
    assert store.flush()
    store.close()
    out = tmp_path / "r.md"
    assert main(["report", "--out", str(out), "--set", f"store.url={url}",
                 "--set", f"paths.runs_dir={tmp_path}"]) == 0
    text = out.read_text()
    assert redact(url) in text and PASSWORD not in text
    assert "1 (0 interrupted)" in text  # the turn written above


async def test_an_outage_loses_no_turn_and_healthz_is_degraded_until_the_server_is_back(
        tmp_path, own_postgres_server):
    postgres_server = own_postgres_server
    postgres_url = postgres_server.create_database("outage")
    shared = tiny_shared()  # a server that is ready at once: no embedded models to load
    try:
        async with serving(server_config(tmp_path, f"store.url={postgres_url}"), shared) as (
                app, base), httpx.AsyncClient(base_url=base) as http:
            state = app.state.server
            for n in range(1, 6):
                state.records.add(make_turn("outage", n, float(n)))
            assert await asyncio.to_thread(state.store.flush)
            fine = (await http.get("/healthz")).json()
            postgres_server.stop()
            try:
                for n in range(6, 16):  # written while the database is down: kept in the journal
                    state.records.add(make_turn("outage", n, float(n)))
                assert await until(lambda: state.store.health()["failing"], 10)
                degraded = (await http.get("/healthz")).json()
            finally:
                postgres_server.start()
            assert await asyncio.to_thread(state.store.flush, 30)
            assert await until(lambda: not state.store.health()["journal_bytes"], 10)
            recovered = (await http.get("/healthz")).json()
            turns = await asyncio.to_thread(state.store.turns)
    finally:
        shared.close()
    assert (fine["status"], degraded["status"], recovered["status"]) == (
        "ready", "degraded", "ready")
    assert degraded["store"]["journal_bytes"] > 0 and degraded["store"]["write_errors"] >= 1
    assert [t["turn"] for t in turns] == list(range(1, 16))


def test_stores_opened_at_once_on_a_new_database_all_open(tmp_path, postgres_url):
    """Concurrent CREATE TABLE IF NOT EXISTS can fail without the schema lock."""
    opened, failed = opened_at_once(
        lambda n: PostgresTurnStore(postgres_url, tmp_path / f"p{n}"), 8)
    assert not failed and opened == 8


def test_two_processes_writing_at_once_lose_nothing(tmp_path, postgres_url):
    writer = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from tests.voiceagent.turns import make_turn
        from voiceagent.dashboard.store_postgres import PostgresTurnStore
        name = sys.argv[1]
        store = PostgresTurnStore({postgres_url!r}, Path({str(tmp_path)!r}) / name)
        for n in range(1, 101):
            store.write(make_turn(name, n, float(n)))
        assert store.flush(60)
        store.close()
    """)
    procs = [subprocess.Popen([sys.executable, "-c", writer, name]) for name in ("a", "b")]
    assert [p.wait(120) for p in procs] == [0, 0]
    store = PostgresTurnStore(postgres_url, tmp_path / "reader")
    assert {c["call_id"]: c["turns"] for c in store.calls()} == {"a": 100, "b": 100}
    store.close()


async def _one_call(base: str) -> None:
    async with TwilioCaller(twilio_url(base)) as caller:
        await caller.start()  # streams silence: the call starts and is stored
        await asyncio.sleep(0.5)
        await caller.hang_up()


async def _ended_calls(base: str, count: int) -> list[dict]:
    """The server's /api/calls once it lists `count` ended calls (or after 15 s)."""
    async with httpx.AsyncClient(base_url=base) as http:
        for _ in range(150):
            calls = (await http.get("/api/calls")).json()["calls"]
            if len(calls) == count and all(c["ended_at"] for c in calls):
                break
            await asyncio.sleep(0.1)
    return calls


@pytest.mark.slow
async def test_two_servers_on_one_postgres_store_each_list_both_calls(
        tmp_path, postgres_url):

    def serve(name: str):
        return running_server("--set", f"store.url={postgres_url}",
                              "--set", f"paths.runs_dir={tmp_path / name}",
                              log_path=tmp_path / f"{name}.log")

    with serve("a") as a, serve("b") as b:
        await _one_call(a)
        [from_a] = [c["call_id"] for c in await _ended_calls(a, 1)]
        await _one_call(b)
        both = {c["call_id"] for c in await _ended_calls(b, 2)}
        assert from_a in both and len(both) == 2
        assert {c["call_id"] for c in await _ended_calls(a, 2)} == both


def test_opening_the_store_waits_on_no_other_process_writing(tmp_path, postgres_url):
    """A no-op CREATE INDEX would wait for the open write below (and, with a second table
    written, deadlock with it)."""
    PostgresTurnStore(postgres_url, tmp_path / "first").close()
    with psycopg.connect(postgres_url) as writing:
        writing.execute("INSERT INTO calls (call_id, kind, started_at) VALUES ('c', 'x', 1)")
        started = time.monotonic()
        PostgresTurnStore(postgres_url, tmp_path / "second").close()
        assert time.monotonic() - started < 5  # a lock wait lasts the 10 s statement timeout
        writing.rollback()
