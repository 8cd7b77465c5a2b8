"""Run the `serve` app in-process on a free loopback port, on the test's event loop."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import uvicorn

from voiceagent.config import Config, load_config
from voiceagent.server.app import create_app


def server_config(tmp_path, *overrides: str) -> Config:
    return load_config(None, [f"paths.runs_dir={tmp_path}/runs", *overrides])


@asynccontextmanager
async def serving(cfg: Config, shared=None):
    """Yield (app, base http URL); the server shuts down like `serve` does on SIGTERM."""
    app = create_app(cfg, shared=shared)
    server = uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
        ws_max_size=4 * cfg.server.max_message_bytes, timeout_graceful_shutdown=5,
    ))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
