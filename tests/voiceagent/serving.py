"""The `serve` app in-process for tests, on a free loopback port and the test's event loop."""

from __future__ import annotations

import asyncio
import time

from voiceagent.config import Config, load_config
from voiceagent.server.serve import serving_in_process as serving

__all__ = ["server_config", "serving", "twilio_url", "until"]


def server_config(tmp_path, *overrides: str) -> Config:
    """The default config with its store under `tmp_path`; calls one after another must not
    meet the previous call's slot still being freed, so 4 slots and no admission by measured
    load (test_admission turns it on) unless `overrides` say. The test's callers share the
    server's event loop and synthesise their speech on it, which on a loaded machine can stall a
    Twilio handshake past the default 5 s `start` deadline: 30 s here. The engine steps on one
    thread: the suite's two workers share two cores, and beside the other worker a 2-thread step
    waits on its OpenMP partner at every layer (two prepared replies made 7 tokens in 2.7 s,
    against 11 ms a step alone); the thread settings have tests of their own, and the soak runs
    on the default threads, as `voiceagent serve` does."""
    return load_config(None, [f"paths.runs_dir={tmp_path}/runs", "server.max_calls=4",
                              "server.admit_clock3_ms=0", "server.start_timeout_s=30",
                              "engine.threads=1", *overrides])


def twilio_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/telephony/twilio"


async def until(predicate, timeout: float) -> bool:
    """Poll `predicate()` until true or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return bool(predicate())
