"""The turn store's write-ahead journal: a write is on disk before it is queued.

Each write is appended as one JSON line (the operating system's page cache: it survives a killed
process) before the store's writer thread commits it. The writer empties the journal whenever it
has committed everything queued. Every process that opens the store has its own journal,
`<store>.journal-<pid>` (`<runs_dir>/postgres.journal-<pid>` for a PostgreSQL store), so a
`voiceagent call` beside a running `serve` never empties the server's; the journals of this
machine's processes that are gone (a kill, a crash, a database that refused writes until the end)
are committed by the next process here to open the store, then deleted. Every write is an upsert,
so committing an entry twice is harmless. A torn last line (killed mid-append) is skipped.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from loguru import logger


class Journal:
    def __init__(self, store: Path):
        self.path = store.with_name(f"{store.name}.journal-{os.getpid()}")
        self.lock = threading.Lock()  # appends (event loop) against truncation (writer)
        self._file = None
        self.size = 0
        self._open()

    def _open(self) -> None:
        if self.path.exists() and self.path.stat().st_size:
            with self.path.open("rb") as f:  # a line torn by a kill must not swallow the next
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
            if torn:
                with self.path.open("a", encoding="utf-8") as f:
                    f.write("\n")
        self._file = self.path.open("a", encoding="utf-8")
        self.size = self._file.tell()

    def append(self, kind: str, payload) -> None:
        """Called with `lock` held (the caller queues the write under the same lock). After
        `close`, the file is opened again: a late write still lands on disk."""
        if self._file is None:
            self._open()
        self._file.write(json.dumps({"kind": kind, "payload": payload}, ensure_ascii=False) + "\n")
        self._file.flush()
        self.size = self._file.tell()

    def entries(self) -> Iterator[tuple[str, object]]:
        """What this journal holds now, oldest first."""
        with self.lock:
            if self._file is not None:
                self._file.flush()
        yield from read_entries(self.path)

    def truncate(self) -> None:
        """Called with `lock` held, once everything appended is committed."""
        if self._file is not None:
            self._file.truncate(0)
            self._file.seek(0)
        self.size = 0

    def close(self) -> None:
        with self.lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_entries(path: Path) -> Iterator[tuple[str, object]]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    for n, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        try:
            entry = json.loads(line)
            yield entry["kind"], entry["payload"]
        except (json.JSONDecodeError, KeyError, TypeError):
            logger.warning(f"turn store journal {path}: line {n} is torn; skipped")


def orphans(store: Path) -> list[Path]:
    """Journals of processes that no longer run (this one's own excluded)."""
    found = []
    for path in store.parent.glob(f"{store.name}.journal-*"):
        pid = path.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            found.append(path)
    return sorted(found)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
