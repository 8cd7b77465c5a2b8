"""Where turn records go: the one interface the server and the dashboard read them through.

`TurnRecords.add` is called on the event loop by the clocks observer; it never blocks: sinks
queue their writes (files, the SQLite store) or only update memory (metrics, live events).
"""

from __future__ import annotations

import json
import queue
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loguru import logger

from voiceagent.pipeline.turn_record import TurnRecord


class TurnSink(Protocol):
    """Where finished turns go: JSONL files, the SQLite turn store, metrics, live events."""

    def write(self, record: TurnRecord) -> None: ...

    def close(self) -> None: ...


@dataclass
class CallInfo:
    """A call as the turn store keeps it, beside its turns."""

    call_id: str
    kind: str
    started_at: float
    method: str | None = None
    config_hash: str | None = None
    pair_card_hash: str | None = None
    ended_at: float | None = None
    call_sid: str | None = None  # Twilio's CallSid, for a phone call


class CallLog(TurnSink, Protocol):
    """A sink that also records when each call starts and ends (the turn store)."""

    def start_call(self, info: CallInfo) -> None: ...

    def end_call(self, call_id: str, ended_at: float) -> None: ...


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
    """Turn records of this process's recent calls, kept in memory, and passed to the sinks.

    Only the `keep_calls` most recent calls stay in memory, so a server that runs for weeks does
    not grow; the durable copy is the sinks' (the turn store).
    """

    def __init__(self, sinks: list[TurnSink] | None = None, keep_calls: int = 100):
        self.sinks = list(sinks or [])
        self.keep_calls = keep_calls
        self.by_call: dict[str, list[TurnRecord]] = defaultdict(list)

    def add(self, record: TurnRecord) -> None:
        self.by_call[record.call_id].append(record)
        while len(self.by_call) > self.keep_calls:  # dicts keep insertion order: oldest first
            del self.by_call[next(iter(self.by_call))]
        for sink in self.sinks:  # one failing sink must not cost the others the turn
            try:
                sink.write(record)
            except Exception:
                logger.exception(f"turn {record.call_id}/{record.turn}: {type(sink).__name__} "
                                 "failed")

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
