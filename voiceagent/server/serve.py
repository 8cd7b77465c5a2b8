"""`voiceagent serve`: the call server under uvicorn, drained on SIGTERM, stopped on SIGINT.

SIGTERM (what systemd and a deploy send) first drains (`ServerState.start_drain`): new calls are
refused with 503 and `/healthz` says "draining", so a balancer sends them elsewhere, while the
calls in progress finish, up to `server.drain_timeout_s`. Then, as on SIGINT (or a second
SIGTERM at once), uvicorn stops accepting, closes open WebSockets (Twilio calls get a close
frame), waits up to GRACE_S for connections, and runs the app's shutdown, which ends the calls
still running (browser calls) and stops the engine.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import sys
from contextlib import asynccontextmanager

import uvicorn
from loguru import logger

from voiceagent.config import Config
from voiceagent.models import resolve
from voiceagent.server.auth import is_public
from voiceagent.server.guard import redact_access_log

GRACE_S = 5
EXIT_CANNOT_LISTEN = 3  # uvicorn's own status for a server that could not start
BACKLOG = 2048  # uvicorn's default


class CannotListen(Exception):
    """The address cannot be bound (port in use, not this machine's address, no permission)."""


def listen(host: str, port: int, send_buffer_bytes: int = 0) -> socket.socket:
    """The listening socket, bound before anything loads: a busy port is one line at once, not
    an error from uvicorn after the models have started loading. Connections it accepts inherit
    its send buffer (`server.send_buffer_bytes`; 0: autotuned)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = f"port {port} is in use; try --port {_free_port(host, port, family)}"
        elif exc.errno == errno.EACCES:
            why = f"no permission for port {port}; try --port {_free_port(host, port, family)}"
        elif exc.errno == errno.EADDRNOTAVAIL:
            why = f"{host} is not an address of this machine; try --host 127.0.0.1"
        else:
            why = exc.strerror or str(exc)
        raise CannotListen(f"cannot listen on {host}:{port}: {why}") from None
    if send_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    return sock


def _free_port(host: str, port: int, family: int) -> int:
    """The first port above `port` that binds now (1024 and up), else any free one."""
    for candidate in range(max(port + 1, 1024), min(max(port + 1, 1024) + 100, 65536)):
        try:
            socket.create_server((host, candidate), family=family).close()
        except OSError:
            continue
        return candidate
    with socket.create_server((host, 0), family=family) as sock:
        return sock.getsockname()[1]


def preflight(cfg: Config) -> None:
    """Fail before binding a port when a configured model is not installed, or is a hub id the
    hub cannot serve now (ModelNotFound)."""
    if cfg.llm.backend == "engine":
        resolve(cfg.engine.target, "llm", setting="engine.target")
        if cfg.engine.draft:
            resolve(cfg.engine.draft, "llm", setting="engine.draft")
    resolve(cfg.asr.model, "asr", setting="asr.model")
    resolve(cfg.tts.voice, "tts", setting="tts.voice")
    resolve(cfg.vad.model, "vad", setting="vad.model")


class Exposed(Exception):
    """Listening off loopback without a token, and the operator did not say they mean it."""


def exposure_notes(cfg: Config) -> list[str]:
    """What the operator must know about who can reach this server; raises Exposed when it
    would be open to anyone without the operator saying so."""
    s = cfg.server
    if not is_public(s):
        return []
    where = s.public_url or s.host
    notes = []
    if not s.token:
        if not s.allow_public_without_token:
            raise Exposed(
                f"refusing to serve {where} without server.token: anyone who reaches it could "
                "place calls and read every transcript. Set VOICEAGENT_TOKEN, or pass "
                "--insecure-public if that is what you mean")
        notes.append(f"INSECURE: serving {where} without a token (--insecure-public): anyone "
                     "who reaches it can place calls and read every transcript")
    if not s.twilio_auth_token:
        notes.append("INSECURE: Twilio calls are taken unsigned (--insecure-public)"
                     if s.allow_public_without_token else
                     "Twilio calls are refused: off loopback they need server.twilio_auth_token "
                     "(or TWILIO_AUTH_TOKEN) to check Twilio's signature")
    return notes


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM drains the app's calls before it stops."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state  # the app's ServerState
        state.request_exit = self.stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._terms = 0  # SIGTERMs received: the first drains, the second stops at once

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def stop(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        drains = sig == signal.SIGTERM and self.state.cfg.server.drain_timeout_s > 0
        self._terms += sig == signal.SIGTERM
        if not drains or self._terms > 1 or self._loop is None:
            super().handle_exit(sig, frame)  # SIGINT, a second SIGTERM, or no drain: stop now
            return
        # A signal handler: the drain starts on the event loop (or goes on, if POST /admin/drain
        # started it).
        self._loop.call_soon_threadsafe(self.state.start_drain)


def uvicorn_config(app, cfg: Config, host: str, port: int, log_level: str) -> uvicorn.Config:
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on",
        # Twilio messages are small; this bounds memory before our own per-message check.
        ws_max_size=4 * cfg.server.max_message_bytes,
        timeout_graceful_shutdown=GRACE_S,
    )
    redact_access_log()  # after uvicorn has configured its loggers
    return config


@asynccontextmanager
async def serving_in_process(cfg: Config, shared=None):
    """Run the app on a free loopback port on this event loop (tests, `bench serve`); yields
    (app, base http URL) and shuts down as `serve` does on SIGTERM."""
    from voiceagent.server.app import create_app

    app = create_app(cfg, shared=shared)
    with listen("127.0.0.1", 0, cfg.server.send_buffer_bytes) as sock:
        port = sock.getsockname()[1]
        server = DrainingServer(uvicorn_config(app, cfg, "127.0.0.1", port, "warning"),
                                app.state.server)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()  # raises what stopped it
            await asyncio.sleep(0.02)
        try:
            yield app, f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 30)


def run_serve(cfg: Config, args) -> int:
    if args.host:
        cfg.server.host = args.host
    if args.port:
        cfg.server.port = args.port
    if getattr(args, "insecure_public", False):
        cfg.server.allow_public_without_token = True
    try:
        notes = exposure_notes(cfg)
    except Exposed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in notes:  # the logs' sink: text, or one JSON object a line with --log-json
        if note.startswith("INSECURE"):
            logger.warning(note)
        else:
            logger.info(f"note: {note}")
    preflight(cfg)
    host, port = cfg.server.host, cfg.server.port
    try:
        sock = listen(host, port, cfg.server.send_buffer_bytes)
    except CannotListen as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_LISTEN
    with sock:
        return _serve_on(cfg, sock)


def _serve_on(cfg: Config, sock: socket.socket) -> int:
    # The app (pipecat, the pipeline) is imported only now: a busy port is found in a second.
    from voiceagent.server.app import create_app

    host, port = cfg.server.host, sock.getsockname()[1]
    failed: list[str] = []

    def on_load_failed(error: str) -> None:
        failed.append(error)
        server.should_exit = True

    app = create_app(cfg, on_load_failed=on_load_failed)
    server = DrainingServer(uvicorn_config(app, cfg, host, port, "info"), app.state.server)
    logger.info(f"voiceagent: call page http://{host}:{port}/ ; Twilio Media Streams "
                f"ws://{host}:{port}/telephony/twilio ; loading models (GET /healthz says when "
                "ready)")
    server.run(sockets=[sock])
    code = 0
    if failed:
        print(f"error: {failed[0]}", file=sys.stderr)
        code = 2
    loader = app.state.server.loader
    if loader is not None and loader.is_alive():
        # Stopped while the models load: the loader thread is inside torch or CTranslate2, and
        # finalising the interpreter under it aborts the process ("terminate called without an
        # active exception"). No call ran, and the store is closed: leave at once.
        logger.info("stopped while loading the models")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
