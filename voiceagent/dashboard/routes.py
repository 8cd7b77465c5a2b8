"""The dashboard's HTTP surface on `serve`: the page, its JSON APIs, live events and /metrics.

All read-only. With `server.token` set every data route here needs it (`Authorization: Bearer`,
or the session cookie the page gets from `POST /api/session`); the page and its charting library
hold no data and stay public, so the page can load and ask for the token. Store reads and the
statistics run off the event loop, over at most `store.max_dashboard_turns` turns; at most
`server.max_event_subscribers` live-event streams are open at once (503 beyond).

| route | returns |
| --- | --- |
| `GET /dashboard` | the page |
| `GET /api/overview?since=` | `stats.overview` of the turns started at or after `since` (unix s) |
| `GET /api/turns?since=&limit=` | `{"turns": [...]}`: the newest `limit` records, oldest first |
| `GET /api/speculation?since=` | `stats.speculation` of those turns |
| `GET /api/calls?since=&before=&limit=` | `{"calls": [...], "next_before": t}`, newest first (1) |
| `GET /api/calls/{call_id}` | `{"call": {...}, "turns": [...]}`; 404 for an unknown id |
| `GET /api/pair-card` | the running pair's card (seed 001); 503 while models load (2) |
| `GET /api/backend` | the pipeline's LLM: `backend`, `model`, `name`; for a remote server also its
  `base_url` and its server-wide `speculation` counters (vLLM's Prometheus), or null |
| `GET /api/events` | server-sent events: `turn` (a turn record) and `call` (started/ended) |
| `GET /metrics` | Prometheus text format |

(1) The next page: `before=next_before`; `next_before` is null on the last page.
(2) 404 when the LLM is a remote server: the pair runs there.

Bad parameters (a negative `since`, `limit` outside 1..500 or 1..10000) are 422 with the reason.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from voiceagent.dashboard.stats import overview, speculation
from voiceagent.pipeline.remote_llm import RemoteChat
from voiceagent.server.auth import authorized
from voiceagent.server.state import ServerState
from voiceagent.urls import redact

STATIC = Path(__file__).resolve().parent.parent / "server" / "static"
KEEPALIVE_S = 15.0
COUNTERS_MAX_AGE_S = 10.0  # a remote LLM's speculation counters, read once for every dashboard


def _server(request: Request) -> ServerState:
    return request.app.state.server


def _authorized(request: Request) -> ServerState:
    server = _server(request)
    if not authorized(request, server.cfg.server.token):
        raise HTTPException(401, "unauthorized: missing or wrong token")
    return server


router = APIRouter(dependencies=[Depends(_authorized)])
public = APIRouter()
Since = Query(None, ge=0, description="unix seconds; only turns/calls started at or after it")


@public.get("/dashboard", include_in_schema=False)
async def dashboard_page():
    return FileResponse(STATIC / "dashboard.html")


@public.get("/static/vendor/plotly.min.js", include_in_schema=False)
async def plotly_js():
    """The charting library, from the installed plotly package: no CDN."""
    spec = importlib.util.find_spec("plotly")
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js" if spec else None
    if path is None or not path.exists():
        raise HTTPException(404, "plotly is not installed: pip install plotly")
    return FileResponse(path, media_type="text/javascript")


async def _off_loop(request: Request, summary, since: float | None,
                    limit: int | None = None) -> dict:
    """`summary` of the newest turns since `since` (at most `limit` and
    `store.max_dashboard_turns`), read and computed on a worker thread: the event loop carries
    live audio."""
    server = _server(request)
    limit = min(limit or server.cfg.store.max_dashboard_turns, server.cfg.store.max_dashboard_turns)
    return await asyncio.to_thread(lambda: summary(server.store.turns(since, limit)))


@router.get("/api/overview")
async def api_overview(request: Request, since: float | None = Since):
    return {"since": since, **await _off_loop(request, overview, since)}


@router.get("/api/turns")
async def api_turns(request: Request, since: float | None = Since,
                    limit: int = Query(2000, ge=1, le=10000)):
    return await _off_loop(request, lambda turns: {"turns": turns}, since, limit)


@router.get("/api/speculation")
async def api_speculation(request: Request, since: float | None = Since):
    return await _off_loop(request, speculation, since)


@router.get("/api/calls")
async def api_calls(request: Request, since: float | None = Since,
                    before: float | None = Query(None, ge=0, description="page cursor"),
                    limit: int = Query(50, ge=1, le=500)):
    calls = await asyncio.to_thread(_server(request).store.calls, since, before, limit + 1)
    more = len(calls) > limit
    calls = calls[:limit]
    return {"calls": calls, "next_before": calls[-1]["started_at"] if more else None}


@router.get("/api/calls/{call_id}")
async def api_call(request: Request, call_id: str):
    found = await asyncio.to_thread(_server(request).store.call, call_id)
    if found is None:
        raise HTTPException(404, f"no call {call_id!r}")
    return found


@router.get("/api/pair-card")
async def api_pair_card(request: Request):
    server = _server(request)
    if server.shared is None:
        raise HTTPException(503, "models still loading")
    if server.shared.llm is None:
        raise HTTPException(404, "no pair card: the LLM is a remote server (see /api/backend)")
    return server.shared.llm.card.to_dict()


@router.get("/api/backend")
async def api_backend(request: Request):
    server = _server(request)
    if server.shared is None:
        raise HTTPException(503, "models still loading")
    chat = server.shared.chat
    info = {"backend": server.cfg.llm.backend, "model": chat.model, "name": chat.name}
    if isinstance(chat, RemoteChat):
        info.update(base_url=redact(chat.cfg.base_url),
                    metrics_url=chat.metrics_url and redact(chat.metrics_url),
                    speculation=await chat.speculation(max_age_s=COUNTERS_MAX_AGE_S))
    return info


@router.get("/api/events")
async def api_events(request: Request):
    hub = _server(request).events
    if hub.full:
        raise HTTPException(503, "too many live-event streams open "
                            f"(at most {hub.max_subscribers})", headers={"Retry-After": "30"})

    async def stream():
        # Subscribed here, inside the generator, so a client gone before the stream starts
        # leaves no subscriber behind; streams that passed the check above together may find
        # the hub full by now: they end at once, and EventSource retries.
        queue = hub.subscribe()
        if queue is None:
            yield "retry: 30000\n: too many live-event streams open\n\n"
            return
        try:
            yield ": live\n\n"
            while not await request.is_disconnected():
                try:
                    yield await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield ": keepalive\n\n"
        finally:
            hub.unsubscribe(queue)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@router.get("/metrics")
async def metrics(request: Request):
    return Response(generate_latest(_server(request).metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)
