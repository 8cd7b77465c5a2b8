"""The turn store on both backends (SQLite; PostgreSQL, on a real server): round trips,
concurrent writers, durability across a kill, journals of gone processes, the schema version,
and retention; and SQLite's locked database. PostgreSQL's own cases: test_store_postgres.py."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests.voiceagent.turns import make_turn
from voiceagent.dashboard.store import SCHEMA_VERSION, SQLTurnStore, StoreError
from voiceagent.dashboard.store_postgres import PostgresTurnStore
from voiceagent.dashboard.store_sqlite import SQLiteTurnStore
from voiceagent.pipeline.records import CallInfo, TurnRecords
from voiceagent.pipeline.turn_record import TurnRecord


@dataclass
class Backend:
    """Where a test's store lives: `files` is the stem of its journals and rejected file; `url`
    a fresh PostgreSQL database, or None for the SQLite file at `files`."""

    files: Path
    url: str | None = None

    def open(self, **options) -> SQLTurnStore:
        if self.url:
            return PostgresTurnStore(self.url, self.files, **options)
        return SQLiteTurnStore(self.files, **options)

    def source(self) -> str:
        """`open()` as Python source, for a subprocess."""
        if self.url:
            return ("from pathlib import Path\n"
                    "from voiceagent.dashboard.store_postgres import PostgresTurnStore\n"
                    f"store = PostgresTurnStore({self.url!r}, Path({str(self.files)!r}))\n")
        return ("from voiceagent.dashboard.store_sqlite import SQLiteTurnStore\n"
                f"store = SQLiteTurnStore({str(self.files)!r})\n")

    def set_schema_version(self, version: int) -> None:
        self.run(f"UPDATE meta SET value = '{version}' WHERE key = 'schema_version'")

    def schema_version(self) -> int:
        sql = "SELECT value FROM meta WHERE key = 'schema_version'"
        if self.url:
            with psycopg.connect(self.url, autocommit=True) as db:
                return int(db.execute(sql).fetchone()[0])
        with sqlite3.connect(self.files) as db:
            return int(db.execute(sql).fetchone()[0])

    def run(self, sql: str) -> None:
        """Run `sql` (statements separated by `;`) on the store's database, outside any store."""
        if self.url:
            with psycopg.connect(self.url, autocommit=True) as db:
                db.execute(sql)
        else:
            with sqlite3.connect(self.files) as db:
                db.executescript(sql)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request, tmp_path) -> Backend:
    if request.param == "sqlite":
        return Backend(tmp_path / "t.sqlite")
    # A fresh database of the session's server, started only when a test gets this far.
    return Backend(tmp_path / "postgres", request.getfixturevalue("postgres_url"))


def test_a_turn_round_trips_with_every_field(backend):
    store = backend.open()
    record = make_turn()
    store.write(record)
    assert store.flush()
    [back] = store.turns()
    assert back == record.to_dict()
    store.close()


def test_calls_are_listed_newest_first_with_their_turn_counts(backend):
    store = backend.open()
    store.start_call(CallInfo("a", "twilio", 10.0, "ngram", "cfg", "card"))
    store.write(make_turn("a", 1, 11.0))
    store.write(make_turn("a", 2, 12.0, interrupted=True))
    store.write(make_turn("b", 1, 20.0))  # a call nobody registered still gets a row
    store.end_call("a", 13.0)
    store.flush()
    calls = store.calls()
    assert [c["call_id"] for c in calls] == ["b", "a"]
    a = calls[1]
    assert (a["kind"], a["turns"], a["interrupted_turns"], a["ended_at"]) == ("twilio", 2, 1, 13.0)
    assert (a["config_hash"], a["pair_card_hash"]) == ("cfg", "card")
    assert store.call("a")["turns"][1]["interrupted"] is True
    assert store.call("nope") is None
    store.close()


def test_concurrent_writers_lose_nothing(backend):
    store = backend.open()

    def one_call(n: int) -> None:
        for turn in range(1, 51):
            store.write(make_turn(f"call{n}", turn, 100.0 * n + turn))

    threads = [threading.Thread(target=one_call, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.flush()
    assert len(store.turns()) == 8 * 50
    assert all(c["turns"] == 50 for c in store.calls(limit=100))
    store.close()


def test_transcripts_off_stores_no_words(backend):
    store = backend.open(transcripts=False)
    store.write(make_turn(user_text="my card number is 4111"))
    store.flush()
    [back] = store.turns()
    assert (back["user_text"], back["bot_text"], back["llm_text"]) == ("", "", "")
    assert back["clocks"]["turn_end_to_first_audio_ms"] == 900.0
    store.close()


def test_a_killed_process_loses_no_committed_turn(backend):
    writer = backend.source() + textwrap.dedent("""
        import time
        from tests.voiceagent.turns import make_turn
        for n in range(1, 41):
            store.write(make_turn("k", n, float(n)))
        store.flush()
        print("committed", flush=True)
        while True:  # keep writing until killed
            n += 1
            store.write(make_turn("k", n, float(n)))
            time.sleep(0.001)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "committed"
    finally:
        proc.kill()  # SIGKILL: no clean-up of any kind
        proc.wait()
    store = backend.open()
    assert store.flush()  # the journal of the killed process is committed first
    turns = store.turns()
    assert len(turns) >= 40
    assert [t["turn"] for t in turns] == list(range(1, len(turns) + 1))  # no gap, no torn row
    store.close()


def test_a_store_of_another_schema_version_is_refused(backend):
    backend.open().close()
    backend.set_schema_version(99)
    with pytest.raises(StoreError, match="schema version 99, this voiceagent reads version "
                                         f"{SCHEMA_VERSION}"):
        backend.open()


def test_a_twilio_call_keeps_its_call_sid(backend):
    store = backend.open()
    store.start_call(CallInfo("t", "twilio", 10.0, "ngram", call_sid="CA" + "1" * 32))
    store.start_call(CallInfo("w", "webrtc", 20.0, "ngram"))
    store.end_call("t", 15.0)  # the end keeps what the start recorded
    store.flush()
    assert {c["call_id"]: c["call_sid"] for c in store.calls()} == {"t": "CA" + "1" * 32,
                                                                    "w": None}
    assert store.call("t")["call"]["call_sid"] == "CA" + "1" * 32
    store.close()


# The store as schema version 1 made it: calls without call_sid.
SCHEMA_V1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE calls (call_id TEXT PRIMARY KEY, kind TEXT NOT NULL,
    started_at DOUBLE PRECISION NOT NULL, ended_at DOUBLE PRECISION, method TEXT,
    config_hash TEXT, pair_card_hash TEXT);
CREATE TABLE turns (call_id TEXT NOT NULL, turn INTEGER NOT NULL,
    started_at DOUBLE PRECISION NOT NULL, method TEXT, interrupted INTEGER NOT NULL,
    record TEXT NOT NULL, PRIMARY KEY (call_id, turn));
CREATE INDEX turns_started ON turns (started_at);
CREATE INDEX calls_started ON calls (started_at);
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO calls VALUES ('old', 'twilio', 10.0, 12.0, 'ngram', 'cfg', 'card');
"""


def test_a_store_of_schema_version_1_is_migrated_keeping_its_calls(backend):
    backend.run(SCHEMA_V1)
    store = backend.open()
    store.start_call(CallInfo("new", "twilio", 20.0, "ngram", call_sid="CAnew"))
    store.write(make_turn("old", 1, 11.0))
    assert store.flush()
    assert store.write_errors == 0, store.last_error
    calls = {c["call_id"]: c for c in store.calls()}
    assert (calls["old"]["call_sid"], calls["old"]["config_hash"], calls["old"]["turns"]) == (
        None, "cfg", 1)
    assert calls["new"]["call_sid"] == "CAnew"
    store.close()
    assert backend.schema_version() == SCHEMA_VERSION


def test_stores_opened_at_once_on_a_version_1_store_all_open(backend):
    """The first migrates; the others wait for it, then find the schema current (two adding
    the column would fail the second)."""
    backend.run(SCHEMA_V1)
    opened, failed = opened_at_once(lambda _n: backend.open(), 6)
    assert not failed and opened == 6


def opened_at_once(open_store, n: int) -> tuple[int, list[Exception]]:
    """`open_store(i)` on `n` threads released together: how many opened, and the errors."""
    at_once = threading.Barrier(n)
    opened, failed = [], []

    def open_one(i: int) -> None:
        at_once.wait()
        try:
            opened.append(open_store(i))
        except Exception as exc:
            failed.append(exc)

    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for store in opened:
        store.close()
    return len(opened), failed


def test_the_server_keeps_only_its_recent_calls_in_memory():
    records = TurnRecords(keep_calls=3)
    for n in range(5):
        records.add(make_turn(f"call{n}"))
    assert list(records.by_call) == ["call2", "call3", "call4"]


def test_stored_record_reads_back_as_the_same_typed_record(tmp_path):
    record = make_turn(clock3_ms=812.5)
    assert TurnRecord.from_dict(record.to_dict()) == record
    # A record stored before a field existed reads back with that field's default.
    old = record.to_dict()
    del old["preparation"], old["breakdown"]["chunk_to_audio_ms"]
    back = TurnRecord.from_dict(old)
    assert back.preparation.prepared == 0 and back.breakdown.chunk_to_audio_ms is None
    assert back.clocks.turn_end_to_first_audio_ms == 812.5


def _locked(db) -> sqlite3.Connection:
    """Another connection that holds the database's write lock until rolled back."""
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    return other


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_writes_the_database_refuses_are_retried_counted_and_all_committed(tmp_path):
    db = tmp_path / "t.sqlite"
    errors: list[str] = []
    store = SQLiteTurnStore(db, max_queue=3, on_error=errors.append)
    store.busy_timeout_s = 0.05
    other = _locked(db)
    for n in range(1, 21):  # more than the queue holds: the rest wait in the journal
        store.write(make_turn("locked", n, float(n)))
    assert _wait(lambda: store.failing)
    health = store.health()
    assert health["queued"] <= 3 and health["journal_bytes"] > 0
    assert "database is locked" in health["last_error"] and errors
    other.rollback()
    other.close()
    assert store.flush()
    assert _wait(lambda: store.health()["journal_bytes"] == 0)
    assert [t["turn"] for t in store.turns()] == list(range(1, 21))
    assert not store.failing
    store.close()


def test_what_a_closing_store_could_not_write_is_committed_at_the_next_start(tmp_path):
    db = tmp_path / "t.sqlite"
    store = SQLiteTurnStore(db)
    store.busy_timeout_s = 0.05
    other = _locked(db)
    store.start_call(CallInfo("c", "twilio", 1.0))
    store.write(make_turn("c", 1, 2.0))
    store.end_call("c", 3.0)
    store.close(timeout=1.0)  # a shutdown that cannot wait for the lock
    other.rollback()
    other.close()
    again = SQLiteTurnStore(db)
    assert again.flush()
    found = again.call("c")
    assert found["call"]["ended_at"] == 3.0 and [t["turn"] for t in found["turns"]] == [1]
    again.close()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_gone_process_journal_is_committed_and_a_torn_line_or_bad_entry_set_aside(backend):
    backend.open().close()
    good = json.dumps({"kind": "turn", "payload": make_turn("j", 1, 1.0).to_dict()})
    bad = json.dumps({"kind": "turn", "payload": {"call_id": "no other field"}})
    later = json.dumps({"kind": "turn", "payload": make_turn("j", 2, 2.0).to_dict()})
    journal = backend.files.with_name(f"{backend.files.name}.journal-{_dead_pid()}")
    journal.write_text("\n".join([good, good[: len(good) // 2], bad, later]) + "\n")
    store = backend.open()
    assert store.flush()
    assert [t["turn"] for t in store.turns()] == [1, 2]  # the torn line and the bad entry skipped
    rejected = backend.files.with_name(f"{backend.files.name}.rejected.jsonl")
    [line] = rejected.read_text().splitlines()
    assert "KeyError" in json.loads(line)["error"]
    assert store.write_errors == 1 and not store.failing
    assert _wait(lambda: not journal.exists())  # committed, then deleted
    store.close()


def test_a_running_process_journal_is_left_alone(backend):
    other = backend.files.with_name(f"{backend.files.name}.journal-1")  # pid 1 always runs
    line = json.dumps({"kind": "turn", "payload": make_turn("theirs", 1, 1.0).to_dict()})
    other.write_text(line + "\n")
    store = backend.open()
    assert store.flush()
    assert store.turns() == [] and other.read_text() == line + "\n"
    store.close()


def test_turns_older_than_the_retention_period_are_deleted(backend):
    now = time.time()
    store = backend.open()
    store.start_call(CallInfo("old", "twilio", now - 40 * 86400))
    store.write(make_turn("old", 1, now - 40 * 86400))
    store.write(make_turn("new", 1, now - 86400))
    store.close()
    kept = backend.open(retention_days=30)  # retention runs as the writer starts
    assert _wait(lambda: [c["call_id"] for c in kept.calls()] == ["new"])
    assert [t["call_id"] for t in kept.turns()] == ["new"]
    kept.close()
