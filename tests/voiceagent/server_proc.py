"""`voiceagent serve` as a subprocess, for tests that talk to the real server over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 300.0  # /healthz answers 503 until the models are loaded; a first start measures
# the machine's costs (80 s of it under the other test worker on CI)
STOP_TIMEOUT_S = 10.0


class ServerFailed(RuntimeError):
    """The server exited or never became healthy; the message ends with its log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextmanager
def running_server(
    *extra_args: str, env: dict[str, str] | None = None, log_path: Path | None = None
) -> Iterator[str]:
    """Run `voiceagent serve` on a free port until healthy; yields its base URL.

    `extra_args` go after `serve` (e.g. "--set", "paths.runs_dir=..."); `env` is added to ours.
    Output goes to `log_path` (a temporary file by default), whose tail is in any failure.
    """
    port = free_port()
    own_log = log_path is None
    if own_log:
        fd, name = tempfile.mkstemp(prefix="voiceagent-serve-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    # 4 slots and no admission by load: a call right after another must not meet the
    # previous call's slot still being freed.
    cmd = [sys.executable, "-m", "voiceagent.cli", "serve", "--port", str(port),
           "--set", "server.max_calls=4", "--set", "server.admit_clock3_ms=0", *extra_args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(proc, base_url, log_path)
        yield base_url
    finally:
        _stop(proc)
        if own_log:
            log_path.unlink(missing_ok=True)


def _wait_healthy(proc: subprocess.Popen, base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"server exited with {proc.returncode}:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{base_url}/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:  # 503: loading, or the load failed
            body = e.read().decode(errors="replace")
            if '"failed"' in body:
                raise ServerFailed(f"model loading failed: {body}\n{log_tail(log_path)}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet
        time.sleep(0.5)
    raise ServerFailed(f"no 200 from /healthz in {READY_TIMEOUT_S:.0f} s:\n{log_tail(log_path)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
