"""The SQLite turn store: round trips, concurrent writers, durability across a kill."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import threading

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
