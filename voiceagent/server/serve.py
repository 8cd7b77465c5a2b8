"""`voiceagent serve`: the call server under uvicorn, shut down cleanly on SIGINT/SIGTERM.

uvicorn handles the signals: it stops accepting, closes open WebSockets (Twilio calls get a close
frame), waits up to GRACE_S for connections, then runs the app's shutdown, which ends the calls
still running (browser calls) and stops the engine.
"""

from __future__ import annotations

import asyncio
import sys
from contextlib import asynccontextmanager

import uvicorn

from voiceagent.config import Config
from voiceagent.models import resolve
from voiceagent.server.app import create_app

GRACE_S = 5


def preflight(cfg: Config) -> None:
    """Fail before binding a port when a configured model is not installed (ModelNotFound)."""
    resolve(cfg.engine.target, "llm")
    if cfg.engine.draft:
        resolve(cfg.engine.draft, "llm")
    resolve(cfg.asr.model, "asr")
    resolve(cfg.tts.voice, "tts")
    resolve(cfg.vad.model, "vad")


def uvicorn_config(app, cfg: Config, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on",
        # Twilio messages are small; this bounds memory before our own per-message check.
        ws_max_size=4 * cfg.server.max_message_bytes,
        timeout_graceful_shutdown=GRACE_S,
    )


@asynccontextmanager
async def serving_in_process(cfg: Config, shared=None):
    """Run the app on a free loopback port on this event loop (tests, `bench serve`); yields
    (app, base http URL) and shuts down as `serve` does on SIGTERM."""
    app = create_app(cfg, shared=shared)
    server = uvicorn.Server(uvicorn_config(app, cfg, "127.0.0.1", 0, "warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
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
    preflight(cfg)
    host, port = cfg.server.host, cfg.server.port
    failed: list[str] = []

    def on_load_failed(error: str) -> None:
        failed.append(error)
        server.should_exit = True

    app = create_app(cfg, on_load_failed=on_load_failed)
    server = uvicorn.Server(uvicorn_config(app, cfg, host, port, "info"))
    if host not in ("127.0.0.1", "localhost", "::1") and not cfg.server.token:
        print(f"warning: listening on {host} without server.token: anyone who can reach "
              "this port can place calls", file=sys.stderr)
    print(f"voiceagent: call page http://{host}:{port}/ ; Twilio Media Streams "
          f"ws://{host}:{port}/telephony/twilio ; loading models (GET /healthz says when ready)",
          file=sys.stderr)
    server.run()
    if failed:
        print(f"error: {failed[0]}", file=sys.stderr)
        return 2
    return 0
