"""The dashboard's HTTP surface on `serve`: the page, its JSON APIs, live events and /metrics.

All read-only. With `server.token` set every data route here needs it (`Authorization: Bearer`,
or the session cookie the page gets from `POST /api/session`); the page and its charting library
hold no data and stay public, so the page can load and ask for the token. Store reads and the
statistics run off the event loop, over at most `store.max_dashboard_turns` turns; at most
`server.max_event_subscribers` live-event streams are open at once (503 beyond).

| route | returns |
| --- | --- |
| `GET /dashboard` | the page |
| `GET /api/overview?since=` | `stats.overview` of the turns started at or after `since` (unix s),
  and `ab_off_share` (the share of calls held out with speculation off, the speed-up's baseline) |
| `GET /api/turns?since=&limit=` | `{"turns": [...]}`: the newest `limit` records, oldest first |
| `GET /api/speculation?since=` | `stats.speculation` of those turns |
| `GET /api/filters?since=` | `stats.facets`: the methods and config hashes there are to filter by |
| `GET /api/calls?since=&before=&limit=` | `{"calls": [...], "next_before": t}`, newest first (1) |
| `GET /api/calls/{call_id}` | `{"call": {...}, "turns": [...], "speculation": [...], "recording"}`:
  each turn's `stats.turn_speculation`, with its `turn`; `recording` (null when not recorded):
  its wall-clock start and `stats.recording_marks`; 404 for an unknown id |
| `GET /api/calls/{call_id}/audio` | the call's recording (WAV; left: caller, right: bot), when
  `store.audio` recorded it, with `X-Recording-Started-At` (unix s at its first sample, the clock
  of the turns' `started_at`); 404 otherwise |
| `GET /api/pair-card` | the running pair's card; 503 while models load (2) |
| `GET /api/backend` | the pipeline's LLM: `backend`, `model`, `name`; for a remote server also its
  `base_url` and its server-wide `speculation` counters (vLLM's Prometheus), or null |
| `GET /api/events` | server-sent events: `turn` (a turn record) and `call` (started/ended) |
| `GET /metrics` | Prometheus text format |

(1) The next page: `before=next_before`; `next_before` is null on the last page.
(2) 404 when the LLM is a remote server: the pair runs there.

Filters: `/api/overview`, `/api/turns`, `/api/speculation` and `/api/calls` also take `method`
(the speculation method: a turn's; for `/api/calls`, a call's, or that of any of its turns, as a
call of method ngram has grammar+ngram turns where a tool call was decoded) and `config_hash`
(the hash of the config its call ran under, as the store records per call). Filtered turns are
those among the newest `store.max_dashboard_turns` of the window.

Bad parameters (a negative `since`, `limit` outside 1..500 or 1..10000) are 422 with the reason.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from voiceagent.dashboard.events import EventStream
from voiceagent.dashboard.stats import (
    facets,
    matching,
    overview,
    recording_marks,
    speculation,
    turn_speculation,
)
from voiceagent.pipeline.failover import FailoverChat
from voiceagent.pipeline.recording import recording_path, started_at
from voiceagent.pipeline.remote_llm import RemoteChat
from voiceagent.pipeline.turn_record import TurnRecord
from voiceagent.urls import redact

# The server uses the dashboard, never the reverse: the app that includes `router` guards it with
# its token (`dependencies=`) and keeps its state, which has what these routes read (`cfg`,
# `store`, `shared`, `events`), at `app.state.server`.
ServerState = Any
STATIC = Path(__file__).resolve().parent / "static"
PAGE_FILES = ("dashboard.js", "recording.js", "dashboard.css")
KEEPALIVE_S = 15.0
COUNTERS_MAX_AGE_S = 10.0  # a remote LLM's speculation counters, read once for every dashboard
CALLS_BATCH = 500  # calls read at a time while filtering the calls list
CALLS_SCAN = 1_000_000  # the most calls read to find the config hashes of a window's turns


def _server(request: Request) -> ServerState:
    return request.app.state.server


router = APIRouter()
public = APIRouter()
Since = Query(None, ge=0, description="unix seconds; only turns/calls started at or after it")
Method = Query(None, min_length=1, max_length=64,
               description="only turns (calls) of this speculation method")
ConfigHash = Query(None, min_length=1, max_length=128,
                   description="only turns (calls) of calls run under this config hash")


@public.get("/dashboard", include_in_schema=False)
async def dashboard_page():
    return FileResponse(STATIC / "dashboard.html")


@public.get("/dashboard/static/{name}", include_in_schema=False)
async def dashboard_file(name: str):
    if name not in PAGE_FILES:
        raise HTTPException(404, "not found")
    return FileResponse(STATIC / name)


@public.get("/static/vendor/plotly.min.js", include_in_schema=False)
async def plotly_js():
    """The charting library, from the installed plotly package: no CDN."""
    spec = importlib.util.find_spec("plotly")
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js" if spec else None
    if path is None or not path.exists():
        raise HTTPException(404, "plotly is not installed: pip install plotly")
    return FileResponse(path, media_type="text/javascript")


def _config_hashes(server: ServerState, turns: list[dict]) -> dict[str, str | None]:
    """Call id -> config hash, for the calls of `turns`. A call starts before its turns, by at
    most `server.max_call_s` (a minute's slack for simulated calls)."""
    if not turns:
        return {}
    earliest = min(t["started_at"] for t in turns) - server.cfg.server.max_call_s - 60.0
    ids = {t["call_id"] for t in turns}
    return {c["call_id"]: c.get("config_hash")
            for c in server.store.calls(earliest, None, CALLS_SCAN) if c["call_id"] in ids}


def _turns(server: ServerState, since: float | None, limit: int | None,
           method: str | None = None, config_hash: str | None = None) -> list[dict]:
    """The newest turns since `since` (at most `limit` and `store.max_dashboard_turns`) of
    `method` and `config_hash` (None: any), oldest first. Blocking: call it off the loop."""
    cap = server.cfg.store.max_dashboard_turns
    limit = min(limit or cap, cap)
    if method is None and config_hash is None:
        return server.store.turns(since, limit)
    turns = server.store.turns(since, cap)
    call_ids = None
    if config_hash is not None:
        hashes = _config_hashes(server, turns)
        call_ids = {call_id for call_id, h in hashes.items() if h == config_hash}
    return matching(turns, method, call_ids)[-limit:]


async def _off_loop(request: Request, summary, since: float | None, limit: int | None = None,
                    method: str | None = None, config_hash: str | None = None) -> dict:
    """`summary` of the turns `_turns` picks, read and computed on a worker thread: the event
    loop carries live audio."""
    server = _server(request)
    return await asyncio.to_thread(
        lambda: summary(_turns(server, since, limit, method, config_hash)))


@router.get("/api/overview")
async def api_overview(request: Request, since: float | None = Since,
                       method: str | None = Method, config_hash: str | None = ConfigHash):
    # ab_off_share: where the speed-up's baseline (the turns with speculation off) comes from.
    return {"since": since, "method": method, "config_hash": config_hash,
            "ab_off_share": _server(request).cfg.server.ab_off_share,
            **await _off_loop(request, overview, since, None, method, config_hash)}


@router.get("/api/turns")
async def api_turns(request: Request, since: float | None = Since,
                    limit: int = Query(2000, ge=1, le=10000),
                    method: str | None = Method, config_hash: str | None = ConfigHash):
    return await _off_loop(request, lambda turns: {"turns": turns}, since, limit, method,
                           config_hash)


@router.get("/api/speculation")
async def api_speculation(request: Request, since: float | None = Since,
                          method: str | None = Method, config_hash: str | None = ConfigHash):
    return await _off_loop(request, speculation, since, None, method, config_hash)


@router.get("/api/filters")
async def api_filters(request: Request, since: float | None = Since):
    """The choices the filters offer in the window, each with how many turns it keeps."""
    server = _server(request)

    def read() -> dict:
        turns = _turns(server, since, None)
        return {"since": since, **facets(turns, _config_hashes(server, turns))}

    return await asyncio.to_thread(read)


def _filtered_calls(server: ServerState, since: float | None, before: float | None, limit: int,
                    method: str | None, config_hash: str | None) -> list[dict]:
    """At most `limit` calls started in [since, before) of `method` (the call's, or one of its
    turns' among the window's newest `store.max_dashboard_turns`) and `config_hash`, newest
    first, read a batch at a time."""
    if method is None and config_hash is None:
        return server.store.calls(since, before, limit)
    with_turns_of_method: set[str] = set()
    if method is not None:
        turns = server.store.turns(since, server.cfg.store.max_dashboard_turns)
        with_turns_of_method = {t["call_id"] for t in matching(turns, method)}

    def keep(c: dict) -> bool:
        return ((method is None or c.get("method") == method
                 or c["call_id"] in with_turns_of_method)
                and (config_hash is None or c.get("config_hash") == config_hash))

    found: list[dict] = []
    while len(found) < limit:
        batch = server.store.calls(since, before, CALLS_BATCH)
        found += [c for c in batch if keep(c)]
        if len(batch) < CALLS_BATCH:
            break
        before = batch[-1]["started_at"]
    return found[:limit]


@router.get("/api/calls")
async def api_calls(request: Request, since: float | None = Since,
                    before: float | None = Query(None, ge=0, description="page cursor"),
                    limit: int = Query(50, ge=1, le=500),
                    method: str | None = Method, config_hash: str | None = ConfigHash):
    calls = await asyncio.to_thread(_filtered_calls, _server(request), since, before, limit + 1,
                                    method, config_hash)
    more = len(calls) > limit
    calls = calls[:limit]
    return {"calls": calls, "next_before": calls[-1]["started_at"] if more else None}


@router.get("/api/calls/{call_id}")
async def api_call(request: Request, call_id: str):
    store = _server(request).store

    def read() -> dict | None:
        found = store.call(call_id)
        if found is not None:
            records = (TurnRecord.from_dict(t) for t in found["turns"])
            found["speculation"] = [{"turn": r.turn, **turn_speculation(r.engine)}
                                    for r in records]
            found["recording"] = _recording(store.recordings, call_id, found["turns"])
        return found

    found = await asyncio.to_thread(read)
    if found is None:
        raise HTTPException(404, f"no call {call_id!r}")
    return found


def _recording(folder: Path | None, call_id: str, turns: list[dict]) -> dict | None:
    """A recorded call's recording: where it starts on the wall clock, and its turns' marks."""
    path = recording_path(folder, call_id) if folder is not None else None
    start = started_at(path) if path is not None and path.is_file() else None
    if start is None:
        return None
    return {"started_at": start, "marks": recording_marks(turns, start)}


@router.get("/api/calls/{call_id}/audio")
async def api_call_audio(request: Request, call_id: str):
    folder = _server(request).store.recordings
    path = recording_path(folder, call_id) if folder is not None else None
    if path is None or not await asyncio.to_thread(path.is_file):
        raise HTTPException(404, f"no recording of call {call_id!r} (store.audio records calls)")
    start = await asyncio.to_thread(started_at, path)
    headers = {"X-Recording-Started-At": f"{start:.3f}"} if start is not None else {}
    return FileResponse(path, media_type="audio/wav", headers=headers)


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
    if isinstance(chat, FailoverChat):
        info["fallback"] = {"name": chat.fallback.name, "model": chat.fallback.model,
                            "served": chat.failovers}
        chat = chat.primary
    if isinstance(chat, RemoteChat):
        info.update(base_url=redact(chat.cfg.base_url),
                    metrics_url=chat.metrics_url and redact(chat.metrics_url),
                    speculation=await chat.speculation(max_age_s=COUNTERS_MAX_AGE_S))
    return info


@router.get("/api/events")
async def api_events(request: Request):
    hub = _server(request).events
    queue = hub.subscribe()  # the slot is taken now, as the request is accepted
    if queue is None:
        raise HTTPException(503, "too many live-event streams open "
                            f"(at most {hub.max_subscribers})", headers={"Retry-After": "30"})
    return EventStream(hub, queue, request, KEEPALIVE_S)


@router.get("/metrics")
async def metrics(request: Request):
    return Response(generate_latest(_server(request).metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)
