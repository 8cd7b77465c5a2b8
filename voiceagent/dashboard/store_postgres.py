"""The PostgreSQL turn store (`store.url`): one database for many `serve` processes, on one
machine or many, so that one dashboard shows every call.

Each process keeps its journal on its own disk (`<runs_dir>/postgres.journal-<pid>`): a turn
that PostgreSQL cannot take now (a restart, an outage) waits there and is committed when the
server is back. Processes that start together create or migrate the schema one at a time (an
advisory lock held by the opening transaction); one that finds the schema current runs no DDL,
which would lock tables that other processes are writing to. A runs dir serves one store: a gone
process's journal there is committed to the store of the next process that opens one. The
password never reaches a message or a log: the URL is shown without it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import psycopg

from voiceagent.dashboard.store import SCHEMA, SQLTurnStore
from voiceagent.urls import redact

# pg_advisory_xact_lock key of the schema's creation and migration ("voic")
SCHEMA_LOCK = 0x766F6963
CONNECT_TIMEOUT_S = 5  # an unreachable host is reported, not waited for
# A host that stops answering mid-query fails the query (retried from the journal) instead of
# holding the writer: unacknowledged data times out, and so does any one statement.
STALL_TIMEOUT_S = 10


class PostgresTurnStore(SQLTurnStore):
    transient = (psycopg.OperationalError,)  # connection lost or refused, shutdown, deadlock
    errors = (psycopg.Error,)

    def __init__(self, url: str, files: Path, transcripts: bool = True, max_queue: int = 10_000,
                 retention_days: float | None = None,
                 on_error: Callable[[str], None] | None = None):
        self.url = url
        super().__init__(redact(url), files, transcripts, max_queue, retention_days, on_error)

    def _explain(self, exc: Exception) -> str:
        # libpq quotes a URL it cannot parse whole, password and all.
        return super()._explain(exc).replace(self.url, self.where)

    def _connect(self) -> psycopg.Connection:
        # autocommit: a transaction only where `_transaction` opens one, none left idle by reads
        return psycopg.connect(
            self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
            tcp_user_timeout=STALL_TIMEOUT_S * 1000, keepalives=1, keepalives_idle=5,
            keepalives_interval=2, keepalives_count=3,
            options=f"-c statement_timeout={STALL_TIMEOUT_S * 1000}")

    def _transaction(self, db: psycopg.Connection) -> AbstractContextManager:
        return db.transaction()

    def _create_schema(self, db: psycopg.Connection) -> None:
        # CREATE ... IF NOT EXISTS alone races: two creators can both miss the table.
        db.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
        # Even a no-op CREATE INDEX locks its table against writes: with another process
        # writing to both tables, that deadlocks. A schema is created whole or not at all.
        if db.execute("SELECT to_regclass('meta') IS NULL").fetchone()[0]:
            db.execute(SCHEMA)

    def _lock_schema(self, db: psycopg.Connection) -> None:
        pass  # `_create_schema` took the schema lock, held until the opening transaction ends

    def _execute(self, db: psycopg.Connection, sql: str, params: tuple = ()) -> psycopg.Cursor:
        return db.execute(sql.replace("?", "%s"), params)
