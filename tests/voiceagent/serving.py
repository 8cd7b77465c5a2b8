"""The `serve` app in-process for tests, on a free loopback port and the test's event loop."""

from __future__ import annotations

from voiceagent.config import Config, load_config
from voiceagent.server.serve import serving_in_process as serving

__all__ = ["server_config", "serving"]


def server_config(tmp_path, *overrides: str) -> Config:
    return load_config(None, [f"paths.runs_dir={tmp_path}/runs", *overrides])


def twilio_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/telephony/twilio"
