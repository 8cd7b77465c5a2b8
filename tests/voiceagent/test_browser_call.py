"""A real browser call: Chromium's fake mic speaks a question to `voiceagent serve` over WebRTC.

The page (voiceagent/server/static) must show the caller's words, the bot's reply and the turn's
clocks, all of which reach it as RTVI messages on the data channel. Its keypad sends RTVI `dtmf`
messages, which the server makes a user turn like a phone's keys.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections import Counter

import numpy as np
import pytest

from audio.wav import write_wav
from tests.audio.speech import silence, speech
from tests.voiceagent import browser
from tests.voiceagent.server_proc import log_tail, running_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(browser.missing() is not None, reason=str(browser.missing())),
]

MIC_RATE = 48000  # the rate Chrome captures and sends at: no resampling of the fake mic
QUESTION = "What is the capital of France?"
LEAD_S = 1.0  # mic silence before the question: the call connects meanwhile
CALL_TIMEOUT_MS = 60_000

PAGE_DONE = """() => {
  const texts = (sel) => [...document.querySelectorAll(sel)].map((e) => e.textContent.trim());
  return texts("#transcript .user:not(.interim)").some((t) => /capital|france/i.test(t))
    && texts("#transcript .bot").some((t) => t.length > 0)
    && document.querySelector("#clocks tr.turn") !== null;
}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    log = tmp / "serve.log"
    with running_server("--set", f"paths.runs_dir={tmp / 'runs'}", log_path=log) as url:
        yield url, log


def _get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.headers.get("content-type", ""), r.read().decode()


def test_call_page_is_served_with_only_local_resources(server):
    url, _ = server
    status, ctype, html = _get(f"{url}/")
    assert status == 200 and ctype.startswith("text/html")
    refs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", html)
    assert refs, html
    local = [r for r in refs if (r.startswith("/") and not r.startswith("//")) or r == "data:,"]
    assert local == refs, refs
    for name, kind in [("call.js", "javascript"), ("call.css", "text/css")]:
        status, ctype, body = _get(f"{url}/static/{name}")
        assert status == 200 and kind in ctype and body, (name, ctype)
        assert not re.search(r"https?://", body), f"{name} names a network resource"


def _mic_wav(path):
    audio = np.concatenate(
        [silence(LEAD_S, MIC_RATE), speech(QUESTION, MIC_RATE), silence(4.0, MIC_RATE)]
    )
    write_wav(path, audio, MIC_RATE)
    return path


def _page_state(page) -> str:
    """What the page shows and what its data channel received, for a failure message."""
    shown = page.evaluate(
        """() => ({
          status: document.querySelector("#status").textContent,
          transcript: [...document.querySelectorAll("#transcript > div")]
            .map((e) => `${e.className}: ${e.textContent}`),
          turns: document.querySelectorAll("#clocks tr.turn").length,
        })"""
    )
    received = page.evaluate("window.__rx || []")
    messages = [json.loads(m) for m in received if m != "ping" and m.startswith("{")]
    kinds = Counter(m.get("type", "?") for m in messages)
    last = [json.dumps(m)[:200] for m in messages[-15:]]
    return (
        f"page: {json.dumps(shown, indent=1)}\n"
        f"data channel: {len(received)} messages, types {dict(kinds)}\nlast:\n" + "\n".join(last)
    )


def test_browser_call_transcribes_answers_and_shows_clocks(server, tmp_path):
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    url, log = server
    wav = _mic_wav(tmp_path / "mic.wav")
    console: list[str] = []

    def expect(ok: bool, why: str) -> None:
        if ok:
            return
        shot = tmp_path / "call-failed.png"
        page.screenshot(path=str(shot), full_page=True)
        pytest.fail(
            f"{why} (screenshot {shot})\n{_page_state(page)}\nconsole:\n"
            + "\n".join(console[-20:])
            + f"\nserver log:\n{log_tail(log)}"
        )

    with sync_playwright() as p:
        chromium = browser.launch(p, wav)
        try:
            page = chromium.new_page()
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.add_init_script(browser.RECORD_DATA_CHANNEL)
            page.goto(f"{url}/")
            expect(page.text_content("#status") == "idle", "the page did not start idle")

            start = time.monotonic()
            page.click("#call")
            try:
                page.wait_for_function(PAGE_DONE, timeout=CALL_TIMEOUT_MS)
                done = True
            except PlaywrightError:
                done = False
            expect(done, f"no transcript + reply + clocks in {CALL_TIMEOUT_MS // 1000} s")
            print(f"\nbrowser call: transcript, reply, clocks in {time.monotonic() - start:.1f} s")

            status = page.text_content("#status")
            expect(status == "connected", f"status {status!r} during the call")
            cells = page.locator("#clocks tr.turn").first.locator("td").all_text_contents()
            expect(len(cells) == 5 and cells[0] == "1", f"turn row {cells}")
            # Request -> first token and turn end -> first audio are measured on every turn.
            expect(all(_is_number(cells[i]) for i in (1, 4)), f"clocks missing in {cells}")

            page.click("#hangup")
            status = page.text_content("#status")
            expect(status == "ended", f"status {status!r} after hang-up")
        finally:
            chromium.close()


# Test-only tap on what the page sends on its data channel: window.__tx.
RECORD_SENT = """
window.__tx = [];
const send = RTCDataChannel.prototype.send;
RTCDataChannel.prototype.send = function (data) {
  window.__tx.push(String(data));
  return send.call(this, data);
};
"""
KEYPAD = """() => [...document.querySelectorAll("#keypad button")]
  .map((b) => [b.dataset.key, b.getAttribute("aria-label") || "", b.disabled])"""
KEYS_SENT = """() => window.__tx.filter((m) => m.startsWith("{")).map((m) => JSON.parse(m))
  .filter((m) => m.type === "dtmf")"""
SHOWS_KEYS = """() => [...document.querySelectorAll("#transcript .user:not(.interim)")]
  .some((e) => e.textContent.trim() === "DTMF: 1#")"""


def test_the_keypad_sends_dtmf_over_rtvi_and_the_keys_become_a_user_turn(server, tmp_path):
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    url, log = server
    wav = tmp_path / "quiet.wav"
    write_wav(wav, silence(LEAD_S, MIC_RATE), MIC_RATE)  # no speech: the keys are the turn

    with sync_playwright() as p:
        chromium = browser.launch(p, wav)
        try:
            page = chromium.new_page()
            page.add_init_script(browser.RECORD_DATA_CHANNEL)
            page.add_init_script(RECORD_SENT)
            page.goto(f"{url}/")
            keys = page.evaluate(KEYPAD)
            assert [k for k, _, _ in keys] == list("123456789*0#"), keys
            assert all(label.startswith("key ") for _, label, _ in keys), keys
            assert all(disabled for _, _, disabled in keys), "keys enabled before a call"

            page.click("#call")
            page.wait_for_function(f"() => !({KEYPAD})()[0][2]", timeout=CALL_TIMEOUT_MS)
            page.click('#keypad button[data-key="1"]')
            page.keyboard.press("#")  # the keyboard's keys too; # sends the digits at once
            sent = page.evaluate(KEYS_SENT)
            assert [(m["label"], m["data"]) for m in sent] == [
                ("rtvi-ai", {"buttons": ["1"]}), ("rtvi-ai", {"buttons": ["#"]})], sent
            try:  # the server's transcript of the keys comes back as the caller's line
                page.wait_for_function(SHOWS_KEYS, timeout=CALL_TIMEOUT_MS)
            except PlaywrightError:
                pytest.fail(f"the keys never came back as a user turn\n{_page_state(page)}"
                            f"\nserver log:\n{log_tail(log)}")

            page.click("#hangup")
            assert all(disabled for _, _, disabled in page.evaluate(KEYPAD)), "keys after hang-up"
        finally:
            chromium.close()


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
