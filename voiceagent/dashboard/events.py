"""Live updates for the dashboard: finished turns and call starts/ends, fanned out to every open
`/api/events` stream (server-sent events). Bounded queues: a stalled browser loses events, it
never grows the server's memory. A stream holds its slot from the moment its request is accepted
until its response ends, however it ends, so the cap holds whatever the timing of its streams."""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

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


class EventStream(StreamingResponse):
    """One `/api/events` stream over a queue already subscribed (`EventHub.subscribe`, at the
    request's acceptance): a check there and a subscription when the stream first runs would let
    streams opened together all pass the check. The slot is freed when the response ends, also
    when it ends before the stream ever ran (a client gone at once)."""

    def __init__(self, hub: EventHub, queue: asyncio.Queue, request: Request, keepalive_s: float):
        self._hub, self._queue = hub, queue
        super().__init__(self._events(request, keepalive_s), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})

    async def _events(self, request: Request, keepalive_s: float):
        yield ": live\n\n"
        while not await request.is_disconnected():
            try:
                yield await asyncio.wait_for(self._queue.get(), keepalive_s)
            except TimeoutError:
                yield ": keepalive\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._hub.unsubscribe(self._queue)
