"""The durable turn store: every finished turn, and the calls they belong to.

`TurnStore` is the interface the server, the dashboard and `voiceagent report` use; SQLite is the
one implementation (a server database such as PostgreSQL can take its place when several `serve`
processes share one dashboard). SQLite runs in WAL mode with synchronous=FULL: each turn is its own
transaction, committed on a writer thread (never on the event loop). Readers open their own
connections; WAL lets them read while the writer writes.

Nothing written is lost: each write goes to a journal file before it is queued
(`voiceagent.dashboard.journal`), so a killed process, a shutdown that cannot wait, or a full
queue (`store.max_queue`) leaves it there to be committed later. A commit the database refuses
for now (locked, disk full) is retried with backoff, counted (`on_error`) and shown by `health()`;
the queue stays bounded meanwhile. A write that can never succeed (a malformed entry) is set aside
in `<store>.rejected.jsonl`, counted, and the writer goes on. Turns and calls older than
`retention_days` are deleted hourly.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loguru import logger

from voiceagent.dashboard.journal import Journal, orphans, read_entries
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
RETENTION_EVERY_S = 3600.0
MAX_BACKOFF_S = 5.0


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

    def health(self) -> dict: ...

    def close(self) -> None: ...

    def calls(self, since: float | None = None, before: float | None = None,
              limit: int = 50) -> list[dict]: ...

    def call(self, call_id: str) -> dict | None: ...

    def turns(self, since: float | None = None, limit: int | None = None) -> list[dict]: ...


class SQLiteTurnStore:
    def __init__(self, path: str | Path, transcripts: bool = True, max_queue: int = 10_000,
                 retention_days: float | None = None,
                 on_error: Callable[[str], None] | None = None):
        self.path = Path(path).expanduser()
        self.transcripts = transcripts
        self.retention_days = retention_days
        self.on_error = on_error  # called on the writer thread with each failure's text
        self.busy_timeout_s = 30.0  # how long a write waits for another writer's lock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.executescript(SCHEMA)
            row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
            elif int(row[0]) != SCHEMA_VERSION:
                raise RuntimeError(f"turn store {self.path} has schema version {row[0]}, this "
                                   f"voiceagent reads version {SCHEMA_VERSION}")
        self._journal = Journal(self.path)
        self._queue: queue.Queue = queue.Queue(max_queue)
        self._overflowed = False  # a write found the queue full: it is in the journal only
        self._closing = False
        self.write_errors = 0
        self.last_error: str | None = None
        self.failing = False  # the last commit failed
        self._db: sqlite3.Connection | None = None
        self._thread = threading.Thread(target=self._run, name="turn-store", daemon=True)
        self._thread.start()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=self.busy_timeout_s)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    # Writes: journaled and queued (never blocking), committed one by one on the writer thread.

    def start_call(self, info: CallInfo) -> None:
        self._submit("call", dataclasses.asdict(info))

    def end_call(self, call_id: str, ended_at: float) -> None:
        self._submit("end", [call_id, ended_at])

    def write(self, record: TurnRecord) -> None:
        self._submit("turn", shareable(record, self.transcripts))

    def _submit(self, kind: str, payload) -> None:
        with self._journal.lock:  # so the writer never truncates between the two
            self._journal.append(kind, payload)
            try:
                self._queue.put_nowait((kind, payload))
            except queue.Full:
                self._overflowed = True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything written so far is committed."""
        done = threading.Event()
        try:
            self._queue.put(("flush", done), timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def health(self) -> dict:
        return {"failing": self.failing, "write_errors": self.write_errors,
                "last_error": self.last_error, "queued": self._queue.qsize(),
                "journal_bytes": self._journal.size}

    def close(self, timeout: float = 10.0) -> None:
        """Commit what is queued, for at most `timeout`; the rest stays in the journal."""
        self._closing = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._journal.close()

    # The writer thread.

    def _run(self) -> None:
        # What earlier processes left uncommitted (this pid's own file: a reused pid).
        self._replay()
        for path in orphans(self.path):
            if self._commit_all(read_entries(path), f"{path.name}"):
                path.unlink(missing_ok=True)
        next_retention = 0.0
        while True:
            if time.monotonic() >= next_retention:
                self._retain()
                next_retention = time.monotonic() + RETENTION_EVERY_S
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                if self._closing:
                    break
                continue
            if item is None:
                break
            kind, payload = item
            if kind == "flush":
                if self._overflowed:  # writes before the flush that only the journal holds
                    self._overflowed = False
                    self._replay()
                payload.set()
            elif not self._commit(kind, payload):
                break  # closing while the database refuses: the journal keeps the rest
            self._settle()
        if self._db is not None:
            self._db.close()

    def _settle(self) -> None:
        """With nothing queued: commit what only the journal holds, then empty it."""
        if not self._queue.empty() or self.failing:
            return
        if self._overflowed:
            self._overflowed = False
            self._replay()
        with self._journal.lock:
            if self._queue.empty() and not self._overflowed and not self.failing:
                self._journal.truncate()

    def _replay(self) -> None:
        self._commit_all(self._journal.entries(), "this process's journal")

    def _commit_all(self, entries, source: str) -> bool:
        entries = list(entries)
        if entries:
            logger.info(f"turn store: committing {len(entries)} journaled write(s) from {source}")
        return all(self._commit(kind, payload) for kind, payload in entries)

    def _commit(self, kind: str, payload) -> bool:
        """Commit one write, retrying with backoff while the database refuses it for now; False
        when the store is closing and still cannot write."""
        delay = 0.05
        while True:
            try:
                if self._db is None:
                    self._db = self._connect()
                with self._db:  # one transaction per write
                    getattr(self, f"_write_{kind}")(self._db, payload)
                if self.failing:
                    logger.info("turn store: writes succeed again")
                self.failing = False
                return True
            except (sqlite3.OperationalError, OSError) as exc:  # locked, busy, disk full, I/O
                self._count(exc, "retrying")
                self.failing = True
                if self._db is not None:
                    self._db.close()
                    self._db = None
                if self._closing:
                    return False
                time.sleep(delay)
                delay = min(2 * delay, MAX_BACKOFF_S)
            except Exception as exc:  # this write can never succeed: set it aside, go on
                self._count(exc, f"set aside in {self._rejected.name}")
                with self._rejected.open("a", encoding="utf-8") as f:
                    f.write(json.dumps({"kind": kind, "payload": payload,
                                        "error": self.last_error}, default=str) + "\n")
                return True

    @property
    def _rejected(self) -> Path:
        return self.path.with_name(self.path.name + ".rejected.jsonl")

    def _count(self, exc: Exception, then: str) -> None:
        self.write_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if not self.failing:
            logger.error(f"turn store {self.path}: write failed ({self.last_error}); {then}")
        if self.on_error is not None:
            self.on_error(self.last_error)

    def _retain(self) -> None:
        if self.retention_days is None:
            return
        cutoff = time.time() - self.retention_days * 86400
        try:
            with self._connect() as db:
                gone = db.execute("DELETE FROM turns WHERE started_at < ?", (cutoff,)).rowcount
                db.execute("DELETE FROM calls WHERE started_at < ? AND call_id NOT IN "
                           "(SELECT call_id FROM turns)", (cutoff,))
            if gone:
                logger.info(f"turn store: deleted {gone} turn(s) older than "
                            f"{self.retention_days:g} days")
        except sqlite3.Error as exc:  # the next hour tries again; writes are unaffected
            self._count(exc, "retention skipped")

    @staticmethod
    def _write_call(db: sqlite3.Connection, info: dict) -> None:
        info = CallInfo(**info)
        db.execute(
            "INSERT OR REPLACE INTO calls VALUES (?, ?, ?, ?, ?, ?, ?)",
            (info.call_id, info.kind, info.started_at, info.ended_at, info.method,
             info.config_hash, info.pair_card_hash),
        )

    @staticmethod
    def _write_end(db: sqlite3.Connection, payload: list) -> None:
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

