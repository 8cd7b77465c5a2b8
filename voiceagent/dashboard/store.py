"""The durable turn store: every finished turn, and the calls they belong to.

`TurnStore` is the interface the server, the dashboard and `voiceagent report` use; `open_store`
picks the backend from the config. SQLite (`store_sqlite`, the default) is one file that one
machine's processes share. PostgreSQL (`store_postgres`, when `store.url` names one) is shared by
`serve` processes on any number of machines, so one dashboard shows all their calls; retention and
the schema check work the same, and journals stay on each machine.

This module holds what both backends share, written once: the schema and SQL, the writer thread,
and its durability. Each turn is its own transaction, committed on the writer thread (never on
the event loop); readers open their own connections.

Nothing written is lost: each write goes to a journal file before it is queued
(`voiceagent.dashboard.journal`), so a killed process, a shutdown that cannot wait, or a full
queue (`store.max_queue`) leaves it there to be committed later. A commit the database refuses
for now (locked, disk full, a PostgreSQL server restarting or out of reach) is retried with
backoff, counted (`on_error`) and shown by `health()` (`/healthz` says "degraded"); the queue
stays bounded meanwhile. A write that can never succeed (a malformed entry) is set aside in
`<store>.rejected.jsonl`, counted, and the writer goes on. Turns and calls older than
`retention_days` are deleted hourly.

A store of an older schema version is migrated (`MIGRATIONS`) by the first newer process that
opens it, one process at a time; one of a newer version than this code reads is refused.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from loguru import logger

from voiceagent.dashboard.journal import Journal, orphans, read_entries
from voiceagent.pipeline.recording import prune_recordings, recordings_dir
from voiceagent.pipeline.records import CallInfo, CallLog
from voiceagent.pipeline.turn_record import TurnRecord

if TYPE_CHECKING:
    from voiceagent.config import Config

SCHEMA_VERSION = 2
# One text for both backends: DOUBLE PRECISION is PostgreSQL's 8-byte float (its REAL has 4
# bytes) and SQLite's REAL. A new column goes last, where a migration's ADD COLUMN puts it.
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS calls (
    call_id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,              -- webrtc | twilio | simulated
    started_at DOUBLE PRECISION NOT NULL,  -- unix seconds
    ended_at DOUBLE PRECISION,
    method TEXT,                     -- speculation method: off | ngram | draft
    config_hash TEXT,
    pair_card_hash TEXT,
    call_sid TEXT                    -- Twilio's CallSid of a phone call (schema version 2)
);
CREATE TABLE IF NOT EXISTS turns (
    call_id TEXT NOT NULL,
    turn INTEGER NOT NULL,
    started_at DOUBLE PRECISION NOT NULL,
    method TEXT,
    interrupted INTEGER NOT NULL,
    record TEXT NOT NULL,            -- TurnRecord.to_dict() as JSON
    PRIMARY KEY (call_id, turn)
);
CREATE INDEX IF NOT EXISTS turns_started ON turns (started_at);
CREATE INDEX IF NOT EXISTS calls_started ON calls (started_at);
"""
# What brings a store of version v up to v + 1, by v: run once, by the first process of a newer
# voiceagent that opens it.
MIGRATIONS = {
    1: ("ALTER TABLE calls ADD COLUMN call_sid TEXT",),
}
TRANSCRIPT_FIELDS = ("user_text", "bot_text", "llm_text")
RETENTION_EVERY_S = 3600.0
MAX_BACKOFF_S = 5.0


class StoreError(ValueError):
    """The store cannot be opened: out of reach, or of a schema version this code does not
    read. A ValueError, so the command line prints it as one line."""


def shareable(record: TurnRecord, transcripts: bool) -> dict:
    """The record as a dict, its words blanked unless transcripts may be kept."""
    data = record.to_dict()
    if not transcripts:
        data.update(dict.fromkeys(TRANSCRIPT_FIELDS, ""))
    return data


class TurnStore(CallLog, Protocol):
    """Writes never block (they are queued); reads return plain dicts, newest first."""

    where: str  # the store's name in messages: its file, or its URL without the password
    recordings: Path | None  # the folder of the calls' recordings, pruned by retention

    def flush(self, timeout: float = 10.0) -> bool: ...

    def health(self) -> dict: ...

    def close(self) -> None: ...

    def calls(self, since: float | None = None, before: float | None = None,
              limit: int = 50) -> list[dict]: ...

    def call(self, call_id: str) -> dict | None: ...

    def turns(self, since: float | None = None, limit: int | None = None) -> list[dict]: ...


def open_store(cfg: Config, on_error: Callable[[str], None] | None = None,
               retain: bool = True) -> TurnStore:
    """The configured store: PostgreSQL when `store.url` is set, else the SQLite file. `retain`
    False: old turns are not deleted by this process (a reader such as `voiceagent report`)."""
    s = cfg.store
    retention_days = s.retention_days if retain else None
    if s.url:
        from voiceagent.dashboard.store_postgres import PostgresTurnStore

        store = PostgresTurnStore(s.url, Path(cfg.paths.runs_dir).expanduser() / "postgres",
                                  s.transcripts, s.max_queue, retention_days, on_error)
    else:
        from voiceagent.config import store_path
        from voiceagent.dashboard.store_sqlite import SQLiteTurnStore

        store = SQLiteTurnStore(store_path(cfg), s.transcripts, s.max_queue, retention_days,
                                on_error)
    store.recordings = recordings_dir(cfg)
    return store


def __getattr__(name: str) -> Any:
    if name == "SQLiteTurnStore":  # its import path from before there were two backends
        from voiceagent.dashboard.store_sqlite import SQLiteTurnStore

        return SQLiteTurnStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SQLTurnStore(ABC):
    """The shared writer and SQL. A backend says how to connect, how a transaction is opened,
    how the schema is created, how its driver spells a parameter, and which errors mean "not
    now" (`transient`: retried) as against "never" (set aside)."""

    transient: tuple[type[Exception], ...]
    errors: tuple[type[Exception], ...]  # every error of the driver

    def __init__(self, where: str, files: Path, transcripts: bool, max_queue: int,
                 retention_days: float | None, on_error: Callable[[str], None] | None):
        """`files`: the stem of this machine's files for the store, `<files>.journal-<pid>` and
        `<files>.rejected.jsonl`."""
        self.where = where
        self.files = files
        self.transcripts = transcripts
        self.retention_days = retention_days
        self.recordings: Path | None = None  # the calls' recordings, deleted with them
        self.on_error = on_error  # called on the writer thread with each failure's text
        files.parent.mkdir(parents=True, exist_ok=True)
        self._open_schema()
        self._journal = Journal(files)
        self._queue: queue.Queue = queue.Queue(max_queue)
        self._overflowed = False  # a write found the queue full: it is in the journal only
        self._closing = False
        self.write_errors = 0
        self.last_error: str | None = None
        self.failing = False  # the last commit failed
        self._db: Any = None
        self._thread = threading.Thread(target=self._run, name="turn-store", daemon=True)
        self._thread.start()

    # What a backend provides.

    @abstractmethod
    def _connect(self) -> Any: ...

    @abstractmethod
    def _transaction(self, db) -> AbstractContextManager: ...

    @abstractmethod
    def _create_schema(self, db) -> None:
        """Create what is missing, inside the transaction that then checks the version."""

    @abstractmethod
    def _execute(self, db, sql: str, params: tuple = ()) -> Any:
        """Run `sql`, written with `?` parameters; the cursor."""

    @abstractmethod
    def _lock_schema(self, db) -> None:
        """Keep other processes from migrating the schema until this transaction ends."""

    # Opening.

    def _open_schema(self) -> None:
        try:
            with self._session() as db, self._transaction(db):
                self._create_schema(db)
                version = self._schema_version(db)
                if version is None:
                    self._execute(db, "INSERT INTO meta VALUES ('schema_version', ?) "
                                  "ON CONFLICT DO NOTHING", (str(SCHEMA_VERSION),))
                elif version < SCHEMA_VERSION:
                    self._lock_schema(db)
                    self._migrate(db, self._schema_version(db))  # another may have meanwhile
                elif version > SCHEMA_VERSION:
                    raise StoreError(f"turn store {self.where} has schema version {version}, "
                                     f"this voiceagent reads version {SCHEMA_VERSION}")
        except self.errors as exc:
            raise StoreError(f"cannot open the turn store {self.where}: {self._explain(exc)}") \
                from None

    def _schema_version(self, db) -> int | None:
        row = self._execute(db, "SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return None if row is None else int(row[0])

    def _migrate(self, db, version: int) -> None:
        """Bring a store of an older schema version up to this one, in the opening transaction."""
        if version == SCHEMA_VERSION:
            return
        for step in range(version, SCHEMA_VERSION):
            for sql in MIGRATIONS[step]:
                self._execute(db, sql)
        self._execute(db, "UPDATE meta SET value = ? WHERE key = 'schema_version'",
                      (str(SCHEMA_VERSION),))
        logger.info(f"turn store {self.where}: schema version {version} brought up to "
                    f"{SCHEMA_VERSION}")

    def _explain(self, exc: Exception) -> str:
        """The error's text on one line, fit for a log and /healthz."""
        return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())

    @contextmanager
    def _session(self) -> Iterator[Any]:
        """A connection of its own, closed after use."""
        db = self._connect()
        try:
            yield db
        finally:
            db.close()

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
        for path in orphans(self.files):
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
                with self._transaction(self._db):  # one transaction per write
                    getattr(self, f"_write_{kind}")(self._db, payload)
                if self.failing:
                    logger.info("turn store: writes succeed again")
                self.failing = False
                return True
            except (*self.transient, OSError) as exc:  # locked, busy, disk full, out of reach
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
        return self.files.with_name(self.files.name + ".rejected.jsonl")

    def _count(self, exc: Exception, then: str) -> None:
        self.write_errors += 1
        self.last_error = f"{type(exc).__name__}: {self._explain(exc)}"
        if not self.failing:
            logger.error(f"turn store {self.where}: write failed ({self.last_error}); {then}")
        if self.on_error is not None:
            self.on_error(self.last_error)

    def _retain(self) -> None:
        if self.retention_days is None:
            return
        cutoff = time.time() - self.retention_days * 86400
        try:
            with self._session() as db, self._transaction(db):
                gone = self._execute(db, "DELETE FROM turns WHERE started_at < ?",
                                     (cutoff,)).rowcount
                self._execute(db, "DELETE FROM calls WHERE started_at < ? AND call_id NOT IN "
                              "(SELECT call_id FROM turns)", (cutoff,))
            if gone:
                logger.info(f"turn store: deleted {gone} turn(s) older than "
                            f"{self.retention_days:g} days")
            if self.recordings is not None and (heard := prune_recordings(self.recordings, cutoff)):
                logger.info(f"turn store: deleted {heard} recording(s) older than "
                            f"{self.retention_days:g} days")
        except self.errors as exc:  # the next hour tries again; writes are unaffected
            self._count(exc, "retention skipped")

    # The writes are upserts: committing a journaled write twice is harmless.

    def _write_call(self, db, info: dict) -> None:
        info = CallInfo(**info)
        self._execute(
            db,
            """INSERT INTO calls (call_id, kind, started_at, ended_at, method, config_hash,
                                  pair_card_hash, call_sid)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (call_id) DO UPDATE
               SET kind = excluded.kind, started_at = excluded.started_at,
                   ended_at = excluded.ended_at, method = excluded.method,
                   config_hash = excluded.config_hash, pair_card_hash = excluded.pair_card_hash,
                   call_sid = excluded.call_sid""",
            (info.call_id, info.kind, info.started_at, info.ended_at, info.method,
             info.config_hash, info.pair_card_hash, info.call_sid),
        )

    def _write_end(self, db, payload: list) -> None:
        self._execute(db, "UPDATE calls SET ended_at = ? WHERE call_id = ?",
                      (payload[1], payload[0]))

    def _write_turn(self, db, data: dict) -> None:
        method = (data.get("engine") or {}).get("method")
        # A turn of a call nobody registered (e.g. a simulated one) still gets its call row.
        self._execute(
            db,
            "INSERT INTO calls (call_id, kind, started_at, method) VALUES (?, ?, ?, ?) "
            "ON CONFLICT DO NOTHING",
            (data["call_id"], "simulated", data["started_at"], method),
        )
        self._execute(
            db,
            """INSERT INTO turns VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (call_id, turn) DO UPDATE
               SET started_at = excluded.started_at, method = excluded.method,
                   interrupted = excluded.interrupted, record = excluded.record""",
            (data["call_id"], data["turn"], data["started_at"], method,
             int(bool(data["interrupted"])), json.dumps(data)),
        )

    # Reads: a connection each, so any thread may call them.

    def _rows(self, sql: str, params: tuple) -> list[dict]:
        with self._session() as db:
            return _dicts(self._execute(db, sql, params))

    def calls(self, since: float | None = None, before: float | None = None,
              limit: int = 50) -> list[dict]:
        """Calls started in [since, before), newest first, with per-call turn counts."""
        return self._rows(
            """SELECT c.*, COUNT(t.turn) AS turns, COALESCE(SUM(t.interrupted), 0)
                   AS interrupted_turns
               FROM calls c LEFT JOIN turns t ON t.call_id = c.call_id
               WHERE c.started_at >= ? AND c.started_at < ?
               GROUP BY c.call_id ORDER BY c.started_at DESC LIMIT ?""",
            (since if since is not None else float("-inf"),
             before if before is not None else float("inf"), limit),
        )

    def call(self, call_id: str) -> dict | None:
        with self._session() as db:
            found = _dicts(self._execute(db, "SELECT * FROM calls WHERE call_id = ?", (call_id,)))
            if not found:
                return None
            turns = self._execute(db, "SELECT record FROM turns WHERE call_id = ? ORDER BY turn",
                                  (call_id,)).fetchall()
        return {"call": found[0], "turns": [json.loads(t[0]) for t in turns]}

    def turns(self, since: float | None = None, limit: int | None = None) -> list[dict]:
        """Turn records started at or after `since`, oldest first (the newest `limit`)."""
        newest = "SELECT record, started_at FROM turns WHERE started_at >= ? ORDER BY " \
                 "started_at DESC" + (" LIMIT ?" if limit else "")
        params = (since if since is not None else float("-inf"),) + ((limit,) if limit else ())
        rows = self._rows(f"SELECT record FROM ({newest}) AS recent ORDER BY started_at", params)
        return [json.loads(r["record"]) for r in rows]


def _dicts(cursor) -> list[dict]:
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
