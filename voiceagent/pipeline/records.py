"""Where turn records go: the one interface the server and the dashboard read them through.

`TurnRecords.add` is called on the event loop by the clocks observer; it never blocks: file
writes happen on a writer thread, and live listeners get the record through an asyncio queue.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections import defaultdict
from pathlib import Path
from typing import Protocol

from voiceagent.pipeline.clocks import TurnRecord


class TurnSink(Protocol):
    """Durable storage of finished turns (JSONL now; the dashboard issue adds SQLite)."""

    def write(self, record: TurnRecord) -> None: ...

    def close(self) -> None: ...


class JsonlTurnSink:
    """One JSONL file per call under `folder`, written off the event loop."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._queue: queue.Queue[TurnRecord | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="turn-jsonl", daemon=True)
        self._thread.start()

    def path_for(self, call_id: str) -> Path:
        return self.folder / f"{call_id}.jsonl"

    def write(self, record: TurnRecord) -> None:
        self._queue.put(record)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        while (record := self._queue.get()) is not None:
            with self.path_for(record.call_id).open("a") as f:
                f.write(json.dumps(record.to_dict()) + "\n")


class TurnRecords:
    """Turn records of every call in this process: kept in memory, stored, and broadcast."""

    def __init__(self, sinks: list[TurnSink] | None = None):
        self.sinks = list(sinks or [])
        self.by_call: dict[str, list[TurnRecord]] = defaultdict(list)
        self._listeners: set[asyncio.Queue] = set()

    def add(self, record: TurnRecord) -> None:
        self.by_call[record.call_id].append(record)
        for sink in self.sinks:
            sink.write(record)
        for listener in self._listeners:
            listener.put_nowait(record)

    def listen(self) -> asyncio.Queue:
        """A queue that receives every record added from now on; `unlisten` it when done."""
        q: asyncio.Queue = asyncio.Queue()
        self._listeners.add(q)
        return q

    def unlisten(self, q: asyncio.Queue) -> None:
        self._listeners.discard(q)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
