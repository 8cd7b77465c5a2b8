"""The SQLite turn store, the default: one file on this machine, no server to run.

WAL mode lets readers read while the writer writes; synchronous=FULL makes each committed turn
survive a power cut. Several processes may share the file (WAL and a busy timeout order them).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from voiceagent.dashboard.store import SCHEMA, SQLTurnStore


class SQLiteTurnStore(SQLTurnStore):
    transient = (sqlite3.OperationalError,)  # locked, busy, disk full, I/O
    errors = (sqlite3.Error,)
    busy_timeout_s = 30.0  # how long a write waits for another writer's lock

    def __init__(self, path: str | Path, transcripts: bool = True, max_queue: int = 10_000,
                 retention_days: float | None = None,
                 on_error: Callable[[str], None] | None = None):
        self.path = Path(path).expanduser()
        super().__init__(str(self.path), self.path, transcripts, max_queue, retention_days,
                         on_error)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=self.busy_timeout_s)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    def _transaction(self, db: sqlite3.Connection) -> sqlite3.Connection:
        return db  # commits on leaving, rolls back on an exception

    def _create_schema(self, db: sqlite3.Connection) -> None:
        db.executescript(SCHEMA)

    def _lock_schema(self, db: sqlite3.Connection) -> None:
        # The write lock, until the opening transaction commits: a second process opening an
        # old store at once waits, then finds it migrated.
        db.execute("BEGIN IMMEDIATE")

    def _execute(self, db: sqlite3.Connection, sql: str, params: tuple = ()) -> sqlite3.Cursor:
        return db.execute(sql, params)
