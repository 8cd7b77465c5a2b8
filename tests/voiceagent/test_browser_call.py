"""A real browser call: Chromium's fake mic speaks a question to `voiceagent serve` over WebRTC.

The page (voiceagent/server/static) must show the caller's words, the bot's reply and the turn's
clocks, speculation figures and tool calls, all of which reach it as RTVI messages on the data
channel, and the microphone's level while it does. Its keypad sends RTVI `dtmf` messages, which
the server makes a user turn like a phone's keys. Mute silences what the server hears; every
failure (the microphone refused or missing, the offer refused) is shown with its fix.
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

    with browser.call_page(wav) as page:
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
        expect(len(cells) == 9 and cells[0] == "1", f"turn row {cells}")
        # Request -> first token, the mean ITL (a reply has several tokens; its p50 may be
        # 0 under speculation) and turn end -> first audio are measured on every turn.
        expect(all(_is_number(cells[i]) for i in (1, 2, 4)), f"clocks missing in {cells}")
        expect(float(cells[2]) > 0, f"a turn's mean ITL shows {cells[2]}")
        # The turn's speculation figures, as the server's turn message has them.
        turn = _turn_messages(page)[0]
        spec = turn["speculation"]
        expect(cells[5] == spec["method"] and spec["method"], f"method: {cells} {spec}")
        if spec["accepted_per_step"] is not None:
            want = f"{spec['accepted_per_step']:.2f}"
            expect(cells[6] == want, f"accepted/step {cells[6]!r}, message {spec}")
        if spec["tokens_per_s"] is not None:
            expect(cells[7] == str(round(spec["tokens_per_s"])), f"tokens/s: {cells} {spec}")
        expect(_is_number(cells[7]), f"no tokens/s in {cells}: {spec}")
        expect(cells[8] == "–" if not turn["tool_calls"] else cells[8] != "–",
               f"tools cell {cells[8]!r}, message {turn['tool_calls']}")
        # The meter moved with the question, and the page's link leads to the dashboard.
        peak = float(page.get_attribute("#meter", "data-peak"))
        expect(peak > METER_SPEECH, f"the meter's peak was {peak} during the question")
        link = page.get_attribute("#dashboard-link", "href")
        expect(link == "/dashboard", f"the dashboard link is {link!r}")
        expect(page.is_hidden("#notice"), f"a notice in a good call: {_notice(page)}")

        page.click("#hangup")
        status = page.text_content("#status")
        expect(status == "ended", f"status {status!r} after hang-up")


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

    url, log = server
    wav = tmp_path / "quiet.wav"
    write_wav(wav, silence(LEAD_S, MIC_RATE), MIC_RATE)  # no speech: the keys are the turn

    with browser.call_page(wav) as page:
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


MIC_STATE = """() => ({
  tracks: (window.__sent || []).map((t) => ({enabled: t.enabled, state: t.readyState})),
  ice: window.__pc ? window.__pc.getConfiguration().iceServers : null,
  pressed: document.querySelector("#mute").getAttribute("aria-pressed"),
  level: Number(document.querySelector("#meter").getAttribute("aria-valuenow")),
  peak: Number(document.querySelector("#meter").dataset.peak),
})"""
# Test-only tap on the page's peer connection and the tracks it sends: window.__pc, __sent.
RECORD_TRACKS = """
window.__sent = [];
const addTransceiver = RTCPeerConnection.prototype.addTransceiver;
RTCPeerConnection.prototype.addTransceiver = function (track, init) {
  window.__pc = this;
  if (track && track.kind) window.__sent.push(track);
  return addTransceiver.call(this, track, init);
};
"""
METER_SPEECH = 0.3  # the meter's level (0..1, -60..0 dBFS) the fake mic's question passes
ICE = [{"urls": ["stun:127.0.0.1:9"]}]  # nothing answers there: host candidates still connect
SPOKE = """() => (window.__rx || [])
  .some((m) => /user-started-speaking|user-transcription/.test(m))"""


def _turn_messages(page) -> list[dict]:
    messages = [json.loads(m) for m in page.evaluate("window.__rx || []") if m.startswith("{")]
    return [m["data"] for m in messages
            if m.get("type") == "server-message" and (m.get("data") or {}).get("type") == "turn"]


def _notice(page) -> dict:
    return page.evaluate("""() => ({
      hidden: document.querySelector("#notice").hidden,
      kind: document.querySelector("#notice").className,
      what: document.querySelector("#notice-what").textContent,
      fix: document.querySelector("#notice-fix").textContent,
      status: document.querySelector("#status").textContent,
    })""")


def test_mute_disables_the_sent_track_so_the_server_hears_nothing(server, tmp_path):
    """Muted before the call, the question the fake mic plays never reaches the server: the
    track is disabled, the meter stays flat, and no speech is reported back. The call uses the
    ICE servers the page gets from /api/ice (here stubbed: the server's are configured in
    `server.ice_servers`)."""
    url, log = server
    wav = _mic_wav(tmp_path / "mic.wav")
    with browser.call_page(wav) as page:
        page.add_init_script(browser.RECORD_DATA_CHANNEL)
        page.add_init_script(RECORD_TRACKS)
        page.route("**/api/ice", lambda route: route.fulfill(json={"ice_servers": ICE}))
        page.goto(f"{url}/")
        page.click("#mute")
        assert page.get_attribute("#mute", "aria-pressed") == "true"
        assert page.text_content("#mute") == "Unmute" and page.is_visible("#muted-badge")

        page.click("#call")
        page.wait_for_function(f"() => !({KEYPAD})()[0][2]", timeout=CALL_TIMEOUT_MS)
        state = page.evaluate(MIC_STATE)
        assert state["tracks"] == [{"enabled": False, "state": "live"}], state
        assert [s["urls"] for s in state["ice"]] == [ICE[0]["urls"]], state
        # The question plays from 1 s to about 3 s of the mic's file; wait past it.
        page.wait_for_timeout(1000 * (LEAD_S + 5))
        spoke = page.evaluate(SPOKE)
        state = page.evaluate(MIC_STATE)
        assert not spoke, f"the server heard speech through mute\n{_page_state(page)}"
        assert state["peak"] == 0, f"the meter moved while muted: {state}"
        assert page.locator("#transcript .user").count() == 0
        assert page.text_content("#status") == "connected", log_tail(log)

        page.click("#mute")
        state = page.evaluate(MIC_STATE)
        assert state["tracks"] == [{"enabled": True, "state": "live"}], state
        assert state["pressed"] == "false" and page.is_hidden("#muted-badge")
        page.click("#hangup")
        assert page.evaluate(MIC_STATE)["tracks"][0]["state"] == "ended"


NO_MIC_PERMISSION = """
navigator.mediaDevices.getUserMedia = () =>
  Promise.reject(new DOMException("Permission denied", "NotAllowedError"));
"""
# The page as Chromium gives it over plain HTTP from another machine: no navigator.mediaDevices.
INSECURE = """
Object.defineProperty(Navigator.prototype, "mediaDevices", {get: () => undefined,
                                                            configurable: true});
Object.defineProperty(window, "isSecureContext", {get: () => false, configurable: true});
"""
BUSY = "server busy: 4 of 4 calls in progress, try again later"


def _refuse_offer(status: int, detail: str, headers: dict | None = None):
    def handle(route):
        route.fulfill(status=status, json={"detail": detail}, headers=headers or {})
    return handle


@pytest.mark.parametrize("case,script,offer,what,fix,status", [
    ("refused", NO_MIC_PERMISSION, None, "The microphone was refused",
     "allow the microphone for this site", "error: microphone refused"),
    ("insecure", INSECURE, None, "The microphone needs HTTPS or localhost",
     "serve the page over HTTPS", "error: the microphone needs HTTPS or localhost"),
    ("busy", None, (503, BUSY, {"Retry-After": "10"}), f"The server can't take a call now: {BUSY}",
     "call again in about 10 s", f"error: {BUSY}"),
    ("origin", None, (403, "origin 'http://elsewhere' not allowed", None),
     "The server refused the call (HTTP 403): origin 'http://elsewhere' not allowed",
     "server.allowed_origins", "error: refused (HTTP 403)"),
])
def test_a_failed_call_says_why_and_the_fix_on_the_page(server, tmp_path, case, script, offer,
                                                        what, fix, status):
    url, _ = server
    wav = tmp_path / "quiet.wav"
    write_wav(wav, silence(LEAD_S, MIC_RATE), MIC_RATE)
    with browser.call_page(wav) as page:
        page.add_init_script(RECORD_TRACKS)
        if script:
            page.add_init_script(script)
        if offer:
            page.route("**/api/offer", _refuse_offer(*offer))
        page.goto(f"{url}/")
        assert page.is_hidden("#notice")
        page.click("#call")
        page.wait_for_selector("#notice", state="visible", timeout=CALL_TIMEOUT_MS)
        shown = _notice(page)
        shot = tmp_path / f"notice-{case}.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shown["what"].startswith(what), (shown, shot)
        assert shown["fix"].startswith("Fix: ") and fix in shown["fix"], (shown, shot)
        assert shown["kind"] == "error" and shown["status"].startswith(status), shown
        assert not page.is_disabled("#call") and page.is_disabled("#hangup")
        # Nothing is left open: a microphone opened for a refused call is stopped.
        tracks = page.evaluate(MIC_STATE)["tracks"]
        assert all(t["state"] == "ended" for t in tracks), tracks


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
