"""The SQLite turn store: round trips, concurrent writers, durability across a kill, a database
that refuses writes, and retention."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.voiceagent.turns import make_turn
from voiceagent.dashboard.store import CallInfo, SQLiteTurnStore
from voiceagent.pipeline.records import TurnRecords
from voiceagent.pipeline.turn_record import TurnRecord


def test_a_turn_round_trips_with_every_field(tmp_path):
    store = SQLiteTurnStore(tmp_path / "t.sqlite")
    record = make_turn()
    store.write(record)
    assert store.flush()
    [back] = store.turns()
    assert back == record.to_dict()
    store.close()


def test_calls_are_listed_newest_first_with_their_turn_counts(tmp_path):
    store = SQLiteTurnStore(tmp_path / "t.sqlite")
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


def test_concurrent_writers_lose_nothing(tmp_path):
    store = SQLiteTurnStore(tmp_path / "t.sqlite")

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


def test_transcripts_off_stores_no_words(tmp_path):
    store = SQLiteTurnStore(tmp_path / "t.sqlite", transcripts=False)
    store.write(make_turn(user_text="my card number is 4111"))
    store.flush()
    [back] = store.turns()
    assert (back["user_text"], back["bot_text"], back["llm_text"]) == ("", "", "")
    assert back["clocks"]["turn_end_to_first_audio_ms"] == 900.0
    store.close()


def test_a_killed_process_loses_no_committed_turn(tmp_path):
    db = tmp_path / "t.sqlite"
    writer = textwrap.dedent(f"""
        import sys, time
        from tests.voiceagent.turns import make_turn
        from voiceagent.dashboard.store import SQLiteTurnStore
        store = SQLiteTurnStore({str(db)!r})
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
    store = SQLiteTurnStore(db)
    assert store.flush()  # the journal of the killed process is committed first
    turns = store.turns()
    assert len(turns) >= 40
    assert [t["turn"] for t in turns] == list(range(1, len(turns) + 1))  # no gap, no torn row
    store.close()


def test_a_store_of_another_schema_version_is_refused(tmp_path):
    db = tmp_path / "t.sqlite"
    SQLiteTurnStore(db).close()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(RuntimeError, match="schema version 99"):
        SQLiteTurnStore(db)


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


def test_a_gone_process_journal_is_committed_and_a_torn_line_or_bad_entry_set_aside(tmp_path):
    db = tmp_path / "t.sqlite"
    SQLiteTurnStore(db).close()
    good = json.dumps({"kind": "turn", "payload": make_turn("j", 1, 1.0).to_dict()})
    bad = json.dumps({"kind": "turn", "payload": {"call_id": "no other field"}})
    later = json.dumps({"kind": "turn", "payload": make_turn("j", 2, 2.0).to_dict()})
    journal = tmp_path / f"t.sqlite.journal-{_dead_pid()}"
    journal.write_text("\n".join([good, good[: len(good) // 2], bad, later]) + "\n")
    store = SQLiteTurnStore(db)
    assert store.flush()
    assert [t["turn"] for t in store.turns()] == [1, 2]  # the torn line and the bad entry skipped
    rejected = (tmp_path / "t.sqlite.rejected.jsonl").read_text().splitlines()
    assert len(rejected) == 1 and "KeyError" in json.loads(rejected[0])["error"]
    assert store.write_errors == 1 and not store.failing
    assert _wait(lambda: not journal.exists())  # committed, then deleted
    store.close()


def test_a_running_process_journal_is_left_alone(tmp_path):
    db = tmp_path / "t.sqlite"
    other = tmp_path / "t.sqlite.journal-1"  # pid 1 always runs
    line = json.dumps({"kind": "turn", "payload": make_turn("theirs", 1, 1.0).to_dict()})
    other.write_text(line + "\n")
    store = SQLiteTurnStore(db)
    assert store.flush()
    assert store.turns() == [] and other.read_text() == line + "\n"
    store.close()


def test_turns_older_than_the_retention_period_are_deleted(tmp_path):
    db = tmp_path / "t.sqlite"
    now = time.time()
    store = SQLiteTurnStore(db)
    store.start_call(CallInfo("old", "twilio", now - 40 * 86400))
    store.write(make_turn("old", 1, now - 40 * 86400))
    store.write(make_turn("new", 1, now - 86400))
    store.close()
    kept = SQLiteTurnStore(db, retention_days=30)  # retention runs as the writer starts
    assert _wait(lambda: [c["call_id"] for c in kept.calls()] == ["new"])
    assert [t["call_id"] for t in kept.turns()] == ["new"]
    kept.close()
