"""Headless Debian Chromium driven by playwright, with a WAV file as its microphone.

The browser is the system one (`/usr/bin/chromium`); a playwright browser download fails here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")

# Offline and quiet: no background fetches, no QUIC, no GPU; fake mic and no permission prompt.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
]

# Test-only tap on the page's data channel: every message it receives lands in window.__rx.
RECORD_DATA_CHANNEL = """
window.__rx = [];
const create = RTCPeerConnection.prototype.createDataChannel;
RTCPeerConnection.prototype.createDataChannel = function (...args) {
  const channel = create.apply(this, args);
  channel.addEventListener("message", (e) => window.__rx.push(String(e.data)));
  return channel;
};
"""


def missing() -> str | None:
    """Why the browser tests can't run here, or None when they can."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (Debian package `chromium`)"
    if importlib.util.find_spec("playwright") is None:
        return "the python package `playwright` is not installed (dev extras)"
    return None


def launch(playwright, mic_wav: Path):
    """A headless Chromium whose microphone plays `mic_wav` once (16-bit PCM WAV), then silence."""
    return playwright.chromium.launch(
        executable_path=str(CHROMIUM),
        headless=True,
        args=[*FLAGS, f"--use-file-for-fake-audio-capture={mic_wav}%noloop"],
    )


@contextmanager
def call_page(mic_wav: Path) -> Iterator:
    """A page in a Chromium `launch`ed with `mic_wav`, closed after."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = launch(playwright, mic_wav)
        try:
            yield chromium.new_page()
        finally:
            chromium.close()
