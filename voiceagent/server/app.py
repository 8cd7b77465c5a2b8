"""The `serve` ASGI app: one FastAPI app for browser calls, phone calls and health.

Models load once, on a background thread, while the server already answers: `/healthz` says 503
until they are ready, and calls that arrive before then are refused with that reason. It says 503
again, with the error, if the LLM engine's worker thread dies: no call could be answered; and
"degraded" (200) while the turn store's writes fail.

Every request passes the Host and Origin guard first (`voiceagent.server.guard`). The pages trade
the token for a session cookie at `POST /api/session` (`voiceagent.server.auth`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from loguru import logger
from starlette.exceptions import HTTPException as StarletteHTTPException

from voiceagent.config import Config
from voiceagent.dashboard import routes as dashboard
from voiceagent.pipeline.builder import SharedModels, load_shared
from voiceagent.server import openai_api, twilio, webrtc
from voiceagent.server.api_schema import install_openapi
from voiceagent.server.auth import SESSION_COOKIE, require_token, token_ok
from voiceagent.server.guard import HostOriginGuard, json_object
from voiceagent.server.state import ServerState, new_state

STATIC = Path(__file__).parent / "static"


def create_app(
    cfg: Config,
    shared: SharedModels | None = None,
    on_load_failed: Callable[[str], None] | None = None,
) -> FastAPI:
    """The app; with `shared` given (tests), models are the caller's to close."""
    state = new_state(cfg, shared)
    owns_models = shared is None

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if owns_models:
            _start_loading(state, asyncio.get_running_loop(), on_load_failed)
        yield
        state.stopped = True
        logger.info(f"shutting down: ending {len(state.calls.active)} call(s)")
        await state.calls.end_all()
        await state.webrtc.close()
        state.records.close()
        if owns_models and state.shared is not None:
            state.shared.close()

    app = FastAPI(title="voiceagent", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_openapi(app)
    app.state.server = state
    app.add_middleware(HostOriginGuard, cfg=cfg.server)

    @app.post("/api/session", status_code=204)
    async def open_session(request: Request, response: Response):
        """The pages' login: the token in, an HttpOnly cookie out (never the token in a URL).
        Tries are limited per client address (`server.session_attempts_per_min`)."""
        token = cfg.server.token
        wait_s = state.sessions.retry_after(request.client.host if request.client else "-")
        if wait_s:
            raise HTTPException(429, "too many sign-in attempts: try again later",
                                headers={"Retry-After": str(wait_s)})
        body = await json_object(request, cfg.server.max_message_bytes)
        if token and not token_ok(token, body.get("token")):
            raise HTTPException(401, "unauthorized: wrong token")
        if token:
            https = request.headers.get("x-forwarded-proto", request.url.scheme) == "https"
            response.set_cookie(SESSION_COOKIE, state.sessions.issue(token), httponly=True,
                                samesite="strict", secure=https,
                                max_age=int(cfg.server.session_ttl_s))

    @app.delete("/api/session", status_code=204)
    async def close_session(request: Request, response: Response):
        """Sign-out: the session ends here, not only in this browser's cookie jar."""
        if cfg.server.token:
            state.sessions.revoke(cfg.server.token, request.cookies.get(SESSION_COOKIE))
        response.delete_cookie(SESSION_COOKIE)

    @app.post("/admin/drain", status_code=202, dependencies=[Depends(require_token)])
    async def drain():
        """A deploy's first step: new calls refused, those in progress finish, then the process
        stops (as on SIGTERM)."""
        state.start_drain()
        return {"status": "draining", "calls": len(state.calls.active),
                "timeout_s": cfg.server.drain_timeout_s}

    @app.get("/healthz")
    async def healthz():
        if state.calls.draining:  # a balancer stops sending calls here
            return JSONResponse({"status": "draining", "calls": len(state.calls.active)}, 503)
        if state.engine_down:
            return JSONResponse({"status": "unhealthy", "error": state.engine_down}, 503)
        if state.ready:
            store = state.store.health()
            # A remote LLM's last request failed: calls are taken, replies may not come.
            llm_error = getattr(state.shared.chat, "last_error", None)
            # Degraded: calls are answered, but turns wait in the journal for the store.
            return {"status": "degraded" if store["failing"] or llm_error else "ready",
                    "calls": len(state.calls.active), "max_calls": state.calls.max_calls,
                    "admission": state.admission.headroom(
                        len(state.calls.active), state.calls.max_calls),
                    "store": store, "llm": {"backend": cfg.llm.backend, "last_error": llm_error},
                    "engine": _engine_health(state.shared.worker)}
        if state.load_error:
            return JSONResponse({"status": "failed", "error": state.load_error}, 503)
        return JSONResponse({"status": "loading", "step": state.loading_step}, 503)

    @app.get("/", include_in_schema=False)
    async def call_page():
        return FileResponse(STATIC / "index.html")

    app.include_router(dashboard.public)  # before the /static mount: it serves /static/vendor/
    app.include_router(dashboard.router, dependencies=[Depends(require_token)])
    app.include_router(webrtc.router)
    app.include_router(twilio.router)
    app.include_router(openai_api.router)
    app.add_exception_handler(StarletteHTTPException, openai_api.http_error)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _engine_health(engine) -> dict | None:
    """The in-process engine's worker: how often it died and served again, and why it last
    died (None: a remote LLM)."""
    if engine is None:
        return None
    return {"worker_restarts": engine.restarts_done, "last_death": engine.last_death}


def _start_loading(state: ServerState, loop: asyncio.AbstractEventLoop, on_failed) -> None:
    """Load on a daemon thread: the event loop keeps serving, and a shutdown during a long first
    load does not wait for it."""

    def progress(msg: str) -> None:
        state.loading_step = msg
        logger.info(msg)

    def load() -> None:
        try:
            shared = load_shared(state.cfg, progress)
        except Exception as exc:  # ModelNotFound, ModelLoadError, IncompatiblePairError, ...
            logger.error(f"model loading failed: {exc}")
            _deliver(_failed, str(exc))
            return
        if not _deliver(_loaded, shared):
            shared.close()  # the event loop is gone

    def _deliver(fn, arg) -> bool:
        try:
            loop.call_soon_threadsafe(fn, arg)
            return True
        except RuntimeError:  # the event loop is closed
            return False

    def _loaded(shared: SharedModels) -> None:
        if state.stopped:  # the server stopped while we loaded
            shared.close()
            return
        state.shared = shared
        logger.info("models loaded: ready for calls")

    def _failed(error: str) -> None:
        state.load_error = error
        if on_failed is not None:
            on_failed(error)

    state.loader = threading.Thread(target=load, name="model-load", daemon=True)
    state.loader.start()
