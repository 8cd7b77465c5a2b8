"""Quiet, useful logs: what a normal call and a health poll write at the default level.

A known-harmless library warning is dropped at the sink (with its reason, `logs.HARMLESS`) and
others are kept; the access lines of `/healthz` and `/metrics` are DEBUG; a real server, called
over Twilio (hung up with `stop`, and with a bare close) and from a browser, logs no WARNING or
ERROR line and no INFO line for the polls.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import urllib.request

import numpy as np
import pytest
import uvicorn
from loguru import logger
from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection

from audio.wav import write_wav
from tests.audio.speech import silence, speech
from tests.voiceagent import browser
from tests.voiceagent.server_proc import running_server
from voiceagent import logs
from voiceagent.sim.twilio_caller import TwilioCaller

VAD_MODULE = "pipecat.turns.user_stop.speech_timeout_user_turn_stop_strategy"
ALLOWED: list[str] = []  # WARNING/ERROR lines a normal call may write: none
LOUD = re.compile(r"\| (WARNING|ERROR|CRITICAL) +\|")
POLLS = re.compile(r'"GET /(healthz|metrics)')


@pytest.fixture
def configured():
    yield
    logs.configure()  # what the next CLI run would set up


def _from(module: str):
    """Loguru as if called from `module` (the name the sink's filter sees)."""
    return logger.patch(lambda record: record.update(name=module))


async def test_known_harmless_pipecat_warnings_are_dropped_and_the_rest_kept(configured, capsys):
    logs.configure("INFO")
    _from(VAD_MODULE).warning("PreparingSpeechTimeoutStopStrategy#0: VAD stop_secs (0.5s) "
                              "differs from the recommended default (0.2s). Built-in p99 ...")
    _from(VAD_MODULE).warning("PreparingSpeechTimeoutStopStrategy#0: VAD stop_secs (0.5s) >= "
                              "STT p99 latency (0.4s). STT wait timeout collapsed to 0s")
    connection = SmallWebRTCConnection()  # no offer: no transceivers of any kind
    connection.video_input_track()
    connection.screen_video_input_track()
    connection.audio_input_track()
    await connection.pc.close()
    err = capsys.readouterr().err
    assert "differs from the recommended" not in err and "video transceiver" not in err
    assert ">= STT p99 latency" in err and "No audio transceiver is available" in err
    assert all(reason for _, _, reason in logs.HARMLESS)


def _access_line(path: str) -> None:
    """A request line as uvicorn's access logger writes it."""
    logging.getLogger("uvicorn.access").info(
        '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "GET", path, "1.1", 200)


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_the_access_lines_of_health_polls_and_scrapes_are_debug(configured, capsys, level):
    logs.configure(level)
    uvicorn.Config(app=None, log_level="info")  # applies uvicorn's logging config, as serve does
    for path in ("/healthz", "/metrics?x=1", "/api/overview"):
        _access_line(path)
    err = capsys.readouterr().err
    assert "/api/overview" in err
    assert bool(POLLS.search(err)) == (level == "DEBUG"), err


async def _twilio_call(base: str, stop: bool) -> None:
    """One question and its reply, then a hang-up: Twilio's `stop`, or the socket closed."""
    async with TwilioCaller(base.replace("http://", "ws://") + "/telephony/twilio") as caller:
        await caller.start()
        said = await caller.say(speech("What is the capital of France?"))
        assert await caller.reply(said.ended, 90) is not None
        if stop:
            await caller.hang_up()
        else:
            caller.closed.set()  # no stop: __aexit__ closes the socket
        await asyncio.sleep(0.5)


def _browser_call(base: str, tmp_path) -> None:
    """A question from Chromium's fake mic, the reply shown, then the page's hang-up button."""
    from playwright.sync_api import sync_playwright

    wav = tmp_path / "mic.wav"
    write_wav(wav, np.concatenate([silence(1.0, 48000), speech("What is the capital of France?",
                                                             48000), silence(4.0, 48000)]), 48000)
    with sync_playwright() as p:
        chromium = browser.launch(p, wav)
        try:
            page = chromium.new_page()
            page.goto(f"{base}/")
            page.click("#call")
            page.wait_for_function("""() => [...document.querySelectorAll("#transcript .bot")]
                .some((e) => e.textContent.trim().length > 0)""", timeout=90_000)
            page.click("#hangup")
        finally:
            chromium.close()


def _ended(log, calls: int) -> bool:
    return log.read_text(errors="replace").count(" ended after ") >= calls


@pytest.mark.slow
def test_normal_calls_and_health_polls_log_no_warning_and_no_info_poll(tmp_path):
    log = tmp_path / "serve.log"
    with running_server("--set", f"paths.runs_dir={tmp_path / 'runs'}", log_path=log) as base:
        for path in ("/healthz", "/metrics"):
            urllib.request.urlopen(base + path, timeout=10).read()
        asyncio.run(_twilio_call(base, stop=True))
        asyncio.run(_twilio_call(base, stop=False))
        calls = 2
        if browser.missing() is None:
            _browser_call(base, tmp_path)
            calls += 1
        deadline = time.monotonic() + 15
        while not _ended(log, calls) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # what a hang-up logs after the call's end
    text = log.read_text(errors="replace")
    assert _ended(log, calls), text[-3000:]
    loud = [line for line in text.splitlines()
            if LOUD.search(line) and not any(a in line for a in ALLOWED)]
    assert loud == [], "\n".join(loud)
    assert not POLLS.search(text), [line for line in text.splitlines() if POLLS.search(line)]
