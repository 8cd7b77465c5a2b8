"""The durable turn store: every finished turn, and the calls they belong to.

`TurnStore` is the interface the server, the dashboard and `voiceagent report` use; SQLite is the
one implementation (a server database such as PostgreSQL can take its place when several `serve`
processes share one dashboard). SQLite runs in WAL mode with synchronous=FULL: each turn is its own
transaction, committed on a writer thread (never on the event loop), so a crash or a kill loses no
turn whose commit returned. Readers open their own connections; WAL lets them read while the writer
writes.
"""

from __future__ import annotations

import json
import queue
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from voiceagent.pipeline.turn_record import TurnRecord

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS calls (
    call_id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,              -- webrtc | twilio | simulated
    started_at REAL NOT NULL,        -- unix seconds
    ended_at REAL,
    method TEXT,                     -- speculation method: off | ngram | draft
    config_hash TEXT,
    pair_card_hash TEXT
);
CREATE TABLE IF NOT EXISTS turns (
    call_id TEXT NOT NULL,
    turn INTEGER NOT NULL,
    started_at REAL NOT NULL,
    method TEXT,
    interrupted INTEGER NOT NULL,
    record TEXT NOT NULL,            -- TurnRecord.to_dict() as JSON
    PRIMARY KEY (call_id, turn)
);
CREATE INDEX IF NOT EXISTS turns_started ON turns (started_at);
CREATE INDEX IF NOT EXISTS calls_started ON calls (started_at);
"""
TRANSCRIPT_FIELDS = ("user_text", "bot_text", "llm_text")


def shareable(record: TurnRecord, transcripts: bool) -> dict:
    """The record as a dict, its words blanked unless transcripts may be kept."""
    data = record.to_dict()
    if not transcripts:
        data.update(dict.fromkeys(TRANSCRIPT_FIELDS, ""))
    return data


@dataclass
class CallInfo:
    call_id: str
    kind: str
    started_at: float
    method: str | None = None
    config_hash: str | None = None
    pair_card_hash: str | None = None
    ended_at: float | None = None


class TurnStore(Protocol):
    """Writes never block (they are queued); reads return plain dicts, newest first."""

    def start_call(self, info: CallInfo) -> None: ...

    def end_call(self, call_id: str, ended_at: float) -> None: ...

    def write(self, record: TurnRecord) -> None: ...

    def flush(self, timeout: float = 10.0) -> bool: ...

    def close(self) -> None: ...

    def calls(self, since: float | None = None, before: float | None = None,
              limit: int = 50) -> list[dict]: ...

    def call(self, call_id: str) -> dict | None: ...

    def turns(self, since: float | None = None, limit: int | None = None) -> list[dict]: ...


class SQLiteTurnStore:
    def __init__(self, path: str | Path, transcripts: bool = True):
        self.path = Path(path).expanduser()
        self.transcripts = transcripts
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.executescript(SCHEMA)
            row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
            elif int(row[0]) != SCHEMA_VERSION:
                raise RuntimeError(f"turn store {self.path} has schema version {row[0]}, this "
                                   f"voiceagent reads version {SCHEMA_VERSION}")
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="turn-store", daemon=True)
        self._thread.start()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    # Writes: queued, committed one by one on the writer thread.

    def start_call(self, info: CallInfo) -> None:
        self._queue.put(("call", info))

    def end_call(self, call_id: str, ended_at: float) -> None:
        self._queue.put(("end", (call_id, ended_at)))

    def write(self, record: TurnRecord) -> None:
        self._queue.put(("turn", shareable(record, self.transcripts)))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is committed."""
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    def _run(self) -> None:
        db = self._connect()
        try:
            while (item := self._queue.get()) is not None:
                kind, payload = item
                if kind == "flush":
                    payload.set()
                    continue
                with db:  # one transaction per item
                    getattr(self, f"_write_{kind}")(db, payload)
        finally:
            db.close()

    @staticmethod
    def _write_call(db: sqlite3.Connection, info: CallInfo) -> None:
        db.execute(
            "INSERT OR REPLACE INTO calls VALUES (?, ?, ?, ?, ?, ?, ?)",
            (info.call_id, info.kind, info.started_at, info.ended_at, info.method,
             info.config_hash, info.pair_card_hash),
        )

    @staticmethod
    def _write_end(db: sqlite3.Connection, payload: tuple[str, float]) -> None:
        db.execute("UPDATE calls SET ended_at = ? WHERE call_id = ?", (payload[1], payload[0]))

    @staticmethod
    def _write_turn(db: sqlite3.Connection, data: dict) -> None:
        method = (data.get("engine") or {}).get("method")
        # A turn of a call nobody registered (e.g. a simulated one) still gets its call row.
        db.execute(
            "INSERT OR IGNORE INTO calls (call_id, kind, started_at, method) VALUES (?, ?, ?, ?)",
            (data["call_id"], "simulated", data["started_at"], method),
        )
        db.execute(
            "INSERT OR REPLACE INTO turns VALUES (?, ?, ?, ?, ?, ?)",
            (data["call_id"], data["turn"], data["started_at"], method,
             int(bool(data["interrupted"])), json.dumps(data)),
        )

    # Reads: a fresh connection each, so any thread may call them.

    def calls(self, since: float | None = None, before: float | None = None,
              limit: int = 50) -> list[dict]:
        """Calls started in [since, before), newest first, with per-call turn counts."""
        with self._connect() as db:
            db.row_factory = sqlite3.Row
            rows = db.execute(
                """SELECT c.*, COUNT(t.turn) AS turns, COALESCE(SUM(t.interrupted), 0)
                       AS interrupted_turns
                   FROM calls c LEFT JOIN turns t ON t.call_id = c.call_id
                   WHERE c.started_at >= ? AND c.started_at < ?
                   GROUP BY c.call_id ORDER BY c.started_at DESC LIMIT ?""",
                (since if since is not None else float("-inf"),
                 before if before is not None else float("inf"), limit),
            ).fetchall()
        return [dict(r) for r in rows]

    def call(self, call_id: str) -> dict | None:
        with self._connect() as db:
            db.row_factory = sqlite3.Row
            row = db.execute("SELECT * FROM calls WHERE call_id = ?", (call_id,)).fetchone()
            if row is None:
                return None
            turns = db.execute(
                "SELECT record FROM turns WHERE call_id = ? ORDER BY turn", (call_id,)
            ).fetchall()
        return {"call": dict(row), "turns": [json.loads(t["record"]) for t in turns]}

    def turns(self, since: float | None = None, limit: int | None = None) -> list[dict]:
        """Turn records started at or after `since`, oldest first (the newest `limit`)."""
        with self._connect() as db:
            rows = db.execute(
                """SELECT record FROM (SELECT record, started_at FROM turns
                   WHERE started_at >= ? ORDER BY started_at DESC LIMIT ?)
                   ORDER BY started_at""",
                (since if since is not None else float("-inf"), limit or -1),
            ).fetchall()
        return [json.loads(r[0]) for r in rows]

