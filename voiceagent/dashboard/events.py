"""Live updates for the dashboard: finished turns and call starts/ends, fanned out to every open
`/api/events` stream (server-sent events). Bounded queues: a stalled browser loses events, it
never grows the server's memory."""

from __future__ import annotations

import asyncio
import json

from voiceagent.dashboard.store import shareable
from voiceagent.pipeline.turn_record import TurnRecord

QUEUE_SIZE = 256


class EventHub:
    def __init__(self, transcripts: bool = True, max_subscribers: int = 16):
        self.transcripts = transcripts
        self.max_subscribers = max_subscribers
        self._subscribers: set[asyncio.Queue] = set()

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    @property
    def full(self) -> bool:
        return len(self._subscribers) >= self.max_subscribers

    def subscribe(self) -> asyncio.Queue | None:
        """A new subscriber's queue; None when `max_subscribers` are already subscribed."""
        if self.full:
            return None
        q: asyncio.Queue = asyncio.Queue(QUEUE_SIZE)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    def publish(self, event: str, data: dict) -> None:
        message = f"event: {event}\ndata: {json.dumps(data)}\n\n"
        for q in self._subscribers:
            if not q.full():
                q.put_nowait(message)

    def write(self, record: TurnRecord) -> None:  # a TurnSink
        self.publish("turn", shareable(record, self.transcripts))

    def close(self) -> None:
        self._subscribers.clear()
