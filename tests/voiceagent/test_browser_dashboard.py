"""The latency dashboard in a real browser: a simulated call through the real pipeline writes its
turns to the store, `voiceagent serve` shows them at /dashboard, and the page's numbers must be the
JSON APIs' numbers (the page renders them, it computes none of them).

A screenshot of the page is always written (its path is printed); a failure message names it and
carries the page's console.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import httpx
import numpy as np
import pytest

from llm_engine.stats import StepStats
from tests.audio.speech import silence, speech
from tests.voiceagent import browser
from tests.voiceagent.server_proc import log_tail, running_server
from tests.voiceagent.turns import make_turn
from voiceagent.config import load_config
from voiceagent.dashboard.store import open_store
from voiceagent.pipeline.records import CallInfo
from voiceagent.pipeline.turn_record import ToolCall
from voiceagent.sim.call import simulate_call

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(browser.missing() is not None, reason=str(browser.missing())),
]

QUESTIONS = ("What is the capital of France?", "And what about Spain?")
# The waterfall's segments, in the page's order (TurnRecord.breakdown keys).
SEGMENTS = ("user_speech_ms", "vad_hangover_ms", "asr_final_ms", "transcript_to_request_ms",
            "tool_call_ms", "tools_ms", "first_token_ms", "first_clause_ms", "tts_first_chunk_ms",
            "chunk_to_audio_ms")
# A hand-built call whose first turn called tools, three days old: outside the page's default
# window (the tests above see only the real call), inside "last 7 d" and the store's retention.
TOOL_CALL_ID = "tool-call"
TOOLS = [ToolCall("lookup_order", 612.4, 87, ok=True), ToolCall("get_weather", 2500.0, 41, False)]
# A hand-built call with speculation off under another config, two days old: the filters' other
# choice in "last 7 d".
OFF_CALL_ID, OFF_CONFIG = "off-call", "feedfacefeedface"
# A hand-built Twilio call, four days old, whose turns speculated unevenly: a plain step, an
# n-gram miss, K from 2 to 6.
TWILIO_CALL_ID, CALL_SID = "twilio-call", "CA0123456789abcdef0123456789abcdef"
CLOCKS = {
    "chart-clock1": lambda t: t["clocks"]["request_to_first_token_ms"],
    "chart-clock2": lambda t: t["clocks"]["itl_ms"]["mean"],
    "chart-clock3": lambda t: t["clocks"]["turn_end_to_first_audio_ms"],
}
PAGE_TIMEOUT_MS = 20_000

METRICS = """(sel) => [...document.querySelectorAll(sel + " [data-metric]")].map((e) => ({
  metric: e.dataset.metric, value: JSON.parse(e.dataset.value), text: e.textContent.trim(),
}))"""
CHART_DATA = """(id) => (document.getElementById(id).data || []).map((t) => ({
  name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || []),
}))"""


def _store_overrides(tmp) -> list[str]:
    return [f"store.path={tmp / 'turns.sqlite'}", f"paths.runs_dir={tmp / 'runs'}",
            "store.audio=true"]


def _serve_args(tmp, *overrides: str) -> list[str]:
    return [arg for kv in [*_store_overrides(tmp), *overrides] for arg in ("--set", kv)]


@pytest.fixture(scope="module")
def stored_call(tmp_path_factory, models):
    """A two-question call through the real pipeline into a fresh store: (tmp dir, call id).

    In real time: fed faster, the second question would reach the bot while it still answers the
    first (a barge-in), not as a turn of its own."""
    tmp = tmp_path_factory.mktemp("dashboard")
    cfg = load_config(None, _store_overrides(tmp))
    spoken = [x for q in QUESTIONS for x in (speech(q), silence(4.0))]
    audio = np.concatenate([silence(0.5), *spoken])
    store = open_store(cfg)
    try:
        result = asyncio.run(simulate_call(cfg, models, audio, realtime=True, store=store))
    finally:
        store.close()
    assert len(result.turns) == len(QUESTIONS), [t.user_text for t in result.turns]
    _store_tool_call(cfg)
    _store_off_call(cfg)
    _store_twilio_call(cfg)
    return tmp, result.call_id


def _store_tool_call(cfg) -> None:
    started = time.time() - 3 * 86400
    store = open_store(cfg)
    store.start_call(CallInfo(TOOL_CALL_ID, "twilio", started, "ngram"))
    with_tools, plain = (make_turn(TOOL_CALL_ID, n, started + n) for n in (1, 2))
    with_tools.breakdown.tool_call_ms, with_tools.breakdown.tools_ms = 180.0, 3150.0
    with_tools.tool_calls = TOOLS
    for record in (with_tools, plain):
        store.write(record)
    store.flush()
    store.close()


def _store_off_call(cfg) -> None:
    started = time.time() - 2 * 86400
    store = open_store(cfg)
    store.start_call(CallInfo(OFF_CALL_ID, "webrtc", started, "off", OFF_CONFIG))
    for n in (1, 2):
        store.write(make_turn(OFF_CALL_ID, n, started + n, method="off"))
    store.flush()
    store.close()


def _store_twilio_call(cfg) -> None:
    started = time.time() - 4 * 86400
    store = open_store(cfg)
    store.start_call(CallInfo(TWILIO_CALL_ID, "twilio", started, "ngram", call_sid=CALL_SID))
    ks = ([(4, 4, 2), (0, 0, 0), (3, 0, 0), (3, 3, 3)],
          [(2, 2, 2), (4, 4, 4), (6, 6, 1), (6, 6, 6), (6, 6, 0)])
    for n, turn_ks in enumerate(ks, 1):
        record = make_turn(TWILIO_CALL_ID, n, started + n)
        record.engine.steps = [
            StepStats(k=k, drafted=d, accepted=a, rejection_pos=None if a == d else a,
                      committed=a + 1, draft_ms=0.5, verify_ms=60.0) for k, d, a in turn_ks]
        record.engine.k_history = [k for k, _, _ in turn_ks]
        store.write(record)
    store.flush()
    store.close()


@pytest.fixture(scope="module")
def server(stored_call):
    tmp, _ = stored_call
    log = tmp / "serve.log"
    with running_server(*_serve_args(tmp), log_path=log) as url:
        yield url, log


class Dashboard:
    """The page, open in Chromium, and what a failure message needs."""

    def __init__(self, chromium, url, log, shot):
        self.page = chromium.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        self.url, self.log, self.shot = url, log, shot
        self.console: list[str] = []
        self.failures = 0
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))

    def api(self, path: str, **params) -> dict:
        r = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        r.raise_for_status()
        return r.json()

    def since(self) -> dict:
        """The window the page asked for, exactly as it sent it."""
        since = json.loads(self.page.get_attribute("#overview", "data-since"))
        return {} if since is None else {"since": since}

    def params(self) -> dict:
        """The window and the filters the page asked for."""
        chosen = json.loads(self.page.get_attribute("#overview", "data-filters") or "{}")
        return {**self.since(), **{k: v for k, v in chosen.items() if v is not None}}

    def expect(self, ok: bool, why: str) -> None:
        if ok:
            return
        self.failures += 1
        shot = self.shot.with_name(f"failed-{self.failures}.png")
        self.page.screenshot(path=str(shot), full_page=True)
        pytest.fail(f"{why}\nscreenshot: {shot}\nconsole:\n" + "\n".join(self.console[-20:])
                    + f"\nserver log:\n{log_tail(self.log)}")

    def open_week(self) -> None:
        """The dashboard, its window set to the last 7 days."""
        self.page.goto(f"{self.url}/dashboard")
        self.page.select_option("#window", "604800")

    def listed(self, call_id: str) -> str:
        """The calls table's row for `call_id`, once it shows, as a selector."""
        row = f'#calls tr[data-call-id="{call_id}"]'
        self.wait(f"() => document.querySelector('{row}') !== null", f"{call_id} is not listed")
        return row

    def wait(self, js: str, why: str, arg=None) -> None:
        from playwright.sync_api import Error as PlaywrightError

        try:
            self.page.wait_for_function(js, arg=arg, timeout=PAGE_TIMEOUT_MS)
        except PlaywrightError:
            self.expect(False, f"{why} (waited {PAGE_TIMEOUT_MS // 1000} s)")


@pytest.fixture(scope="module")
def chromium(stored_call):
    """One browser for the module: a second sync playwright can't start while one runs. After
    the call (`stored_call`): playwright's event loop would stop `asyncio.run` in this thread."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=str(browser.CHROMIUM), headless=True, args=browser.FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def dashboard(chromium, server, tmp_path_factory):
    url, log = server
    d = Dashboard(chromium, url, log, tmp_path_factory.mktemp("screenshots") / "dashboard.png")
    d.page.goto(f"{url}/dashboard")
    d.wait(f"""() => {{
      const e = document.querySelector('#overview [data-metric="turns"]');
      return e !== null && e.dataset.value === "{len(QUESTIONS)}";
    }}""", "the overview never showed the call's turns")
    yield d
    d.page.screenshot(path=str(d.shot), full_page=True)
    print(f"\ndashboard screenshot: {d.shot}")


def _at(d: dict, path: str):
    for key in path.split("."):
        d = d[key]
    return d


def _shown_as(value, metric: str, text: str) -> bool:
    """The page's text for `value`: ms rounded, shares in whole percent, 2 decimals per step."""
    if metric.endswith("off_turns"):  # beside a speed-up: off's turns, or that there are none
        return text == (str(value) if value else "no off")
    if value is None:
        return text == "–"
    if metric == "itl_speedup.value":
        return text == f"{value:.2f}×"
    if metric.startswith("accepted_per_step") or metric == "k_mean":
        return abs(float(text) - value) <= 0.005 + 1e-9
    if metric.endswith("_share") or metric == "acceptance_rate":
        return text.endswith("%") and abs(int(text[:-1]) - 100 * value) <= 0.5
    if metric.endswith("_ms") or "_ms." in metric:
        return text == str(math.floor(value + 0.5))  # JS Math.round: halves go up
    return text == str(value)


def test_page_loads_only_local_resources(server):
    url, _ = server
    html = httpx.get(f"{url}/dashboard", timeout=10).text
    refs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", html)
    assert "/static/vendor/plotly.min.js" in refs, refs
    assert all((r.startswith("/") and not r.startswith("//")) or r == "data:," for r in refs), refs
    for name in ("dashboard.js", "dashboard.css"):
        r = httpx.get(f"{url}/dashboard/static/{name}", timeout=10)
        assert r.status_code == 200 and not re.search(r"https?://", r.text), name


def test_overview_numbers_are_the_apis(dashboard):
    api = dashboard.api("/api/overview", **dashboard.since())
    shown = dashboard.page.evaluate(METRICS, "#overview")
    dashboard.expect(len(shown) >= 10, f"overview metrics: {shown}")
    dashboard.expect(api["turns"] == len(QUESTIONS) and api["calls"] == 1, f"api: {api}")
    for m in shown:
        want = _at(api, m["metric"])
        dashboard.expect(m["value"] == want, f"overview {m['metric']}: page {m}, api {want}")
        dashboard.expect(_shown_as(want, m["metric"], m["text"]),
                         f"overview {m['metric']}: {want} shown as {m['text']!r}")


def test_by_method_table_has_a_row_per_method_with_the_apis_numbers(dashboard):
    by_method = dashboard.api("/api/overview", **dashboard.since())["by_method"]
    rows = dashboard.page.eval_on_selector_all(
        "#by-method tr[data-method]", "(rows) => rows.map((r) => r.dataset.method)")
    dashboard.expect(sorted(rows) == sorted(by_method), f"rows {rows}, api {list(by_method)}")
    for method, figures in by_method.items():
        shown = dashboard.page.evaluate(METRICS, f'#by-method tr[data-method="{method}"]')
        for m in shown:
            want = _at(figures, m["metric"])
            dashboard.expect(m["value"] == want and _shown_as(want, m["metric"], m["text"]),
                             f"{method} {m['metric']}: page {m} api {want}")
    # The real call alone has no turns with speculation off: the page says how to get some.
    baseline = dashboard.page.text_content("#baseline")
    dashboard.expect("off" not in by_method and baseline.startswith("No turns with speculation")
                     and "server.ab_off_share" in baseline, f"baseline note: {baseline!r}")


def _shown(dashboard, selector: str) -> dict:
    return {m["metric"]: m for m in dashboard.page.evaluate(METRICS, selector)}


def test_the_speed_up_shows_the_turns_it_is_over(chromium, server, tmp_path):
    """In "last 7 d" both off and a speculative method have turns: each row's speed-up has its
    own and off's sample sizes beside it, and the cards say how many turns they are over."""
    url, log = server
    d = Dashboard(chromium, url, log, tmp_path / "dashboard-samples.png")
    d.open_week()
    d.wait("""() => document.querySelector('#by-method tr[data-method="off"]') !== null""",
           "no speculation-off row in the last 7 days")
    by_method = d.api("/api/overview", **d.params())["by_method"]
    off_turns = by_method["off"]["samples"]["itl_turns"]
    d.expect(off_turns == 2 and len(by_method) >= 2, f"api by method: {list(by_method)}")
    for method, figures in by_method.items():
        shown = _shown(d, f'#by-method tr[data-method="{method}"]')
        want = figures["samples"]["itl_turns"]
        n = shown.get("itl_speedup.turns")
        d.expect(n is not None and n["value"] == want and n["text"] == str(want),
                 f"{method}: sample size {n}, api {want}")
        d.expect(shown["samples.speculative_steps"]["value"]
                 == figures["samples"]["speculative_steps"], f"{method}: {shown}")
        if method != "off":
            vs = shown["itl_speedup.off_turns"]
            d.expect(vs["value"] == off_turns and vs["text"] == str(off_turns),
                     f"{method}: off's sample size {vs}, api {off_turns}")
            cell = d.page.locator(f'#by-method tr[data-method="{method}"] '
                                  '[data-metric="itl_speedup.value"]').locator("..").inner_text()
            d.expect(f"({want} vs {off_turns} turns)" in cell, f"{method} speed-up: {cell!r}")
    baseline = d.page.text_content("#baseline")
    d.expect(baseline.startswith("Baseline: the turns with speculation off"),
             f"baseline note: {baseline!r}")
    cards = _shown(d, "#overview")
    overview = d.api("/api/overview", **d.params())
    for key in ("turn_end_to_first_audio_ms", "itl_turns", "accepted_per_step_turns"):
        d.expect(cards[f"samples.{key}"]["value"] == overview["samples"][key],
                 f"card sample size {key}: {cards.get(f'samples.{key}')}")
    d.page.screenshot(path=str(d.shot), full_page=True)
    d.page.context.close()


def test_filters_by_method_and_config_hash_narrow_the_page(chromium, server, stored_call,
                                                          tmp_path):
    _, call_id = stored_call
    url, log = server
    d = Dashboard(chromium, url, log, tmp_path / "dashboard-filters.png")
    d.open_week()
    real_config = d.api(f"/api/calls/{call_id}")["call"]["config_hash"]
    d.wait(f"""() => document.querySelector('#filter-config option[value="{OFF_CONFIG}"]')
                     && document.querySelector('#filter-method option[value="off"]')""",
           "the filters never offered the off call's method and config")

    def narrowed(method: str, config: str, calls: list[str], turns: int) -> None:
        d.page.select_option("#filter-method", method)
        d.page.select_option("#filter-config", config)
        want = {k: v for k, v in (("method", method), ("config_hash", config)) if v}
        d.wait("""([want, n]) => {
          const o = document.getElementById("overview");
          const f = JSON.parse(o.dataset.filters || "{}");
          const t = o.querySelector('[data-metric="turns"]');
          return (f.method || "") === (want.method || "")
            && (f.config_hash || "") === (want.config_hash || "")
            && t !== null && Number(t.dataset.value) === n;
        }""", f"the page never showed {turns} turns for {want}", [want, turns])
        params = d.params()
        d.expect({k: params.get(k) for k in want} == want, f"the page asked for {params}")
        api = d.api("/api/overview", **params)
        for m in _shown(d, "#overview").values():
            d.expect(m["value"] == _at(api, m["metric"]), f"{want}: {m} != api")
        listed = d.page.eval_on_selector_all(
            "#calls tr[data-call-id]", "(rows) => rows.map((r) => r.dataset.callId)")
        d.expect(sorted(listed) == sorted(calls), f"{want}: calls {listed}, want {calls}")
        plotted = sum(len(t["y"]) for t in d.page.evaluate(CHART_DATA, "chart-clock3"))
        d.expect(plotted == turns, f"{want}: {plotted} turns plotted, want {turns}")

    everything = d.api("/api/overview", since=time.time() - 604800)["turns"]
    narrowed("off", "", [OFF_CALL_ID], 2)
    narrowed("", real_config, [call_id], len(QUESTIONS))
    narrowed("off", real_config, [], 0)
    narrowed("", "", [call_id, TOOL_CALL_ID, OFF_CALL_ID, TWILIO_CALL_ID], everything)
    d.page.screenshot(path=str(d.shot), full_page=True)
    d.page.context.close()


def test_clock_charts_plot_each_turns_clocks(dashboard):
    turns = dashboard.api("/api/turns", **dashboard.since())["turns"]
    for chart, clock in CLOCKS.items():
        traces = dashboard.page.evaluate(CHART_DATA, chart)
        plotted = sorted(y for t in traces for y in t["y"])
        want = sorted(v for t in turns if (v := clock(t)) is not None)
        dashboard.expect(len(plotted) >= 1 and plotted == want,
                         f"{chart}: plotted {plotted}, turns have {want}")


def test_calls_list_shows_the_call_and_a_click_draws_its_waterfall(dashboard, stored_call):
    _, call_id = stored_call
    page = dashboard.page
    row = f'#calls tr[data-call-id="{call_id}"]'
    dashboard.expect(page.locator(row).count() == 1, f"call {call_id} not in #calls")
    turns = dashboard.api(f"/api/calls/{call_id}")["turns"]

    page.click(row)
    _wait_for_waterfall(dashboard, len(turns))
    traces = page.evaluate(CHART_DATA, "chart-waterfall")
    for key, trace in zip(SEGMENTS, traces, strict=True):
        want = [t["breakdown"].get(key) or 0 for t in turns]  # a segment not measured is 0
        dashboard.expect(trace["x"] == want, f"waterfall {key}: {trace['x']} != {want}")
    # Drawn, not only given to plotly: a bar per turn and segment, a label per turn.
    bars = page.locator("#chart-waterfall .barlayer .trace .point path").count()
    labels = page.locator("#chart-waterfall .ytick").count()
    dashboard.expect(bars == len(SEGMENTS) * len(turns) and labels == len(turns),
                     f"{bars} bar segments and {labels} turn labels drawn for {len(turns)} turns")

    rows = page.locator("#call-turns tbody tr[data-turn]")
    dashboard.expect(rows.count() == len(turns), f"{rows.count()} turn rows, {len(turns)} turns")
    for i, t in enumerate(turns):
        row_el = rows.nth(i)
        dashboard.expect(t["user_text"] in row_el.inner_text(), f"turn {t['turn']} text missing")
        shown = row_el.evaluate("""(r) => Object.fromEntries(
          [...r.querySelectorAll("[data-metric]")]
            .map((e) => [e.dataset.metric, JSON.parse(e.dataset.value)]))""")
        want = {"request_to_first_token_ms": t["clocks"]["request_to_first_token_ms"],
                "itl_ms.mean": t["clocks"]["itl_ms"]["mean"],
                "turn_end_to_first_audio_ms": t["clocks"]["turn_end_to_first_audio_ms"]}
        dashboard.expect(shown == want, f"turn {t['turn']} clocks: page {shown}, api {want}")


def test_a_recorded_call_shows_its_waveform_with_marks_and_plays_from_a_turn(dashboard,
                                                                            stored_call):
    _, call_id = stored_call
    page = dashboard.page
    found = dashboard.api(f"/api/calls/{call_id}")
    turns, started = found["turns"], found["recording"]["started_at"]
    page.click(f'#calls tr[data-call-id="{call_id}"]')
    dashboard.wait("() => document.getElementById('waveform').dataset.drawn === '1'",
                   "the recording's waveform was never drawn")
    # Three marks a turn (its speech end, the hangover, the first audio); no barge-in here.
    marks = int(page.get_attribute("#waveform", "data-marks"))
    dashboard.expect(marks == len(found["recording"]["marks"]) == 3 * len(turns),
                     f"{marks} marks drawn for {len(turns)} turns")
    inked = page.evaluate("""() => {
      const c = document.getElementById("waveform");
      const px = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
      const lane = (top) => { let n = 0;
        for (let y = top; y < top + c.height / 2; y++) for (let x = 0; x < c.width; x++) {
          if (px[(y * c.width + x) * 4 + 3] > 0) n++; }
        return n; };
      return [lane(0), lane(c.height / 2)];
    }""")
    dashboard.expect(min(inked) > 2000, f"pixels drawn per lane (caller, bot): {inked}")
    last = turns[-1]
    speech_end = last["started_at"] - started + last["breakdown"]["user_speech_ms"] / 1000
    page.click(f'#call-turns tbody tr[data-turn="{last["turn"]}"]')
    dashboard.wait("""(at) => { const a = document.getElementById("call-audio");
      return !a.paused && a.currentTime >= at && a.currentTime < at + 3; }""",
                   "the click did not play the turn from a second before its speech end",
                   max(0.0, speech_end - 1))
    page.evaluate("() => document.getElementById('call-audio').pause()")


def _wait_for_waterfall(dashboard, turns: int) -> None:
    dashboard.wait("""([segments, n]) => {
      const d = document.getElementById("chart-waterfall").data;
      return Array.isArray(d) && d.length === segments && d.every((t) => t.y.length === n);
    }""", "no waterfall with a bar per turn after the click", [len(SEGMENTS), turns])


def test_a_turn_with_tool_calls_shows_them_on_the_waterfall_and_in_its_row(chromium, server,
                                                                          tmp_path):
    url, log = server
    d = Dashboard(chromium, url, log, tmp_path / "dashboard-tools.png")
    d.open_week()
    row = d.listed(TOOL_CALL_ID)
    d.page.click(row)
    _wait_for_waterfall(d, 2)
    tools = d.page.evaluate("""() => document.getElementById("chart-waterfall").data
      .filter((t) => t.name === "tools")
      .map((t) => ({x: Array.from(t.x), text: t.text, hover: t.hovertext}))""")
    d.expect(len(tools) == 1 and tools[0]["x"] == [3150.0, 0], f"tools segment: {tools}")
    shown = ["lookup_order 612 ms · 87 chars", "get_weather 2500 ms · 41 chars (error)"]
    d.expect(all(s in tools[0]["hover"][0] for s in shown), f"tools hover: {tools[0]['hover']}")
    drawn = d.page.locator("#chart-waterfall .barlayer text").all_text_contents()
    d.expect("lookup_order, get_weather" in drawn, f"bar texts drawn: {drawn}")
    cells = d.page.eval_on_selector_all(
        '#call-turns tr[data-turn] td.tools', """(tds) => tds.map((td) =>
          [...td.querySelectorAll(".tool")].map((e) => [e.dataset.tool, e.textContent]))""")
    d.expect(cells == [[["lookup_order", shown[0]], ["get_weather", shown[1]]], []],
             f"the turns' tool cells: {cells}")
    d.page.screenshot(path=str(d.shot), full_page=True)
    print(f"\ndashboard screenshot with tool calls: {d.shot}")
    d.page.context.close()


def test_speculation_charts_plot_the_apis_histograms(dashboard):
    spec = dashboard.api("/api/speculation", **dashboard.since())
    for chart, hist in (("chart-accepted", spec["accepted_per_step_hist"]),
                        ("chart-rejection", spec["rejection_position_hist"])):
        traces = dashboard.page.evaluate(CHART_DATA, chart)
        plotted = traces[0]["y"] if traces else []
        dashboard.expect(plotted == hist, f"{chart}: plotted {plotted}, api {hist}")
    steps = dashboard.page.evaluate(CHART_DATA, "chart-draft-verify")
    points = [len(t["x"]) for t in steps]
    dashboard.expect(sum(points) == len(spec["steps"]),
                     f"draft/verify points: {points}, api {len(spec['steps'])}")
    k_lines = dashboard.page.evaluate(CHART_DATA, "chart-k")
    with_k = [h for h in spec["k_history"] if h["k"]]
    dashboard.expect(len(k_lines) == min(20, len(with_k)), f"{len(k_lines)} K lines")


K_LEGEND = """() => {
  const legend = [...document.querySelectorAll("#chart-k .legend .traces")];
  const title = (sel) => (document.querySelector(`#chart-k ${sel}`) || {}).textContent || "";
  return {
    entries: legend.map((e) => e.querySelector(".legendtext").textContent),
    xtitle: title(".g-xtitle"),
    ytitle: title(".g-ytitle"),
  };
}"""


def test_k_chart_has_a_legend_naming_each_turn_under_its_method_and_titled_axes(dashboard):
    spec = dashboard.api("/api/speculation", **dashboard.since())
    with_k = [h for h in spec["k_history"] if h["k"]][-20:]
    dashboard.expect(bool(with_k), f"no turn with a K history: {spec['k_history']}")
    lines = dashboard.page.evaluate("""() => document.getElementById("chart-k").data
      .map((t) => ({name: t.name, group: t.legendgroup, colour: t.line.color}))""")
    want = {(f"call {h['call_id']} turn {h['turn']}", h["method"]) for h in with_k}
    dashboard.expect({(t["name"], t["group"]) for t in lines} == want,
                     f"K lines {lines}, want {want}")
    dashboard.expect(all(len({t["colour"] for t in lines if t["group"] == m}) == 1
                         for m in {t["group"] for t in lines}), f"a colour per method: {lines}")
    drawn = dashboard.page.evaluate(K_LEGEND)
    methods = {h["method"] for h in with_k}
    # Drawn: a group title per method, then an entry per turn.
    dashboard.expect(sorted(drawn["entries"]) == sorted([*methods, *(n for n, _ in want)]),
                     f"K legend drawn: {drawn['entries']}, want {methods} and {want}")
    dashboard.expect(drawn["xtitle"] == "decode step of the turn's reply"
                     and drawn["ytitle"] == "K asked for (0: a plain step)",
                     f"K axes titled {drawn['xtitle']!r} and {drawn['ytitle']!r}")


def test_a_twilio_call_shows_its_call_sid_and_each_turns_speculation(chromium, server, tmp_path):
    url, log = server
    d = Dashboard(chromium, url, log, tmp_path / "dashboard-twilio.png")
    d.open_week()
    row = d.listed(TWILIO_CALL_ID)
    listed = d.page.text_content(f"{row} td.call-sid").strip()
    d.expect(listed == CALL_SID, f"the calls list shows CallSid {listed!r}")
    others = d.page.eval_on_selector_all(
        f'#calls tr[data-call-id="{OFF_CALL_ID}"] td.call-sid', "(tds) => tds.map((td) => "
        "td.textContent)")
    d.expect(others == ["–"], f"a WebRTC call's CallSid cell: {others}")

    d.page.click(row)
    found = d.api(f"/api/calls/{TWILIO_CALL_ID}")
    d.wait("""(n) => document.querySelectorAll("#call-speculation tr[data-turn]").length === n
                && document.getElementById("call-sid") !== null""",
           "no per-turn speculation or CallSid after the click", len(found["speculation"]))
    title = d.page.text_content("#call-title")
    d.expect(d.page.text_content("#call-sid") == CALL_SID and CALL_SID in title,
             f"call title: {title!r}")
    rows = d.page.eval_on_selector_all("#call-speculation tr[data-turn]", """(rows) => rows.map(
      (r) => ({turn: Number(r.dataset.turn), method: r.querySelector("td.method").textContent,
               text: r.textContent,
               shown: Object.fromEntries([...r.querySelectorAll("[data-metric]")].map(
                 (e) => [e.dataset.metric, [JSON.parse(e.dataset.value), e.textContent]]))}))""")
    d.expect(len(rows) == 2, f"speculation rows: {rows}")
    for got, want in zip(rows, found["speculation"], strict=True):
        d.expect(got["turn"] == want["turn"] and got["method"] == want["method"],
                 f"turn {want['turn']}: {got}")
        for key, (value, text) in got["shown"].items():
            d.expect(value == want[key] and _shown_as(want[key], key, text),
                     f"turn {want['turn']} {key}: page {value} as {text!r}, api {want[key]}")
    # What each turn's row reads as (the API's figures, as test_dashboard_api checks them).
    one, two = (" ".join(r["text"].split()) for r in rows)
    d.expect("2 / 4" in one and "2.50" in one and "71% (5 of 7)" in one and "3–4" in one
             and "3.33" in one, f"turn 1 reads {one!r}")
    d.expect("5 / 5" in two and "2.60" in two and "54% (13 of 24)" in two and "2–6" in two
             and "4.80" in two, f"turn 2 reads {two!r}")
    d.page.screenshot(path=str(d.shot), full_page=True)
    print(f"\ndashboard screenshot of a Twilio call: {d.shot}")
    d.page.context.close()


def test_pair_card_and_live_indicator(dashboard):
    card = dashboard.api("/api/pair-card")
    shown = dashboard.page.text_content("#card-hash")
    dashboard.expect(shown == card["card_hash"], f"card hash {shown!r}, api {card['card_hash']!r}")
    dashboard.wait("""() => document.getElementById("live").textContent === "live" """,
                   "the live indicator never said live (EventSource on /api/events)")


TOKEN = "dashboard-test-token"


@pytest.fixture(scope="module")
def token_server(stored_call):
    tmp, _ = stored_call
    log = tmp / "serve-token.log"
    with running_server(*_serve_args(tmp, f"server.token={TOKEN}"), log_path=log) as url:
        yield url, log


def test_with_a_token_the_page_asks_for_it_then_works_with_it(chromium, token_server, tmp_path):
    """The page and its script are public; it asks for the token, trades it for a session cookie,
    and no URL it requests carries the token."""
    url, log = token_server
    d = Dashboard(chromium, url, log, tmp_path / "dashboard-token.png")
    requested: list[str] = []
    d.page.on("request", lambda r: requested.append(r.url))
    d.page.goto(f"{url}/dashboard")
    d.wait("""() => {
      const box = document.getElementById("signin-box");
      return !box.hidden && box.querySelector("#signin input[type=password]") !== null;
    }""", "no sign-in form on the page without a token")
    d.page.fill("#signin input[type=password]", "wrong")
    d.page.click("#signin button")
    d.wait("""() => document.querySelector("#signin label").textContent.includes("refused")""",
           "a wrong token was not refused")
    d.page.fill("#signin input[type=password]", TOKEN)
    d.page.click("#signin button")
    d.wait(f"""() => {{
      const turns = document.querySelector('#overview [data-metric="turns"]');
      const clock3 = document.getElementById("chart-clock3").data || [];
      return turns !== null && turns.dataset.value === "{len(QUESTIONS)}"
        && clock3.some((t) => t.y.length > 0)
        && document.getElementById("live").textContent === "live"
        && document.getElementById("error").hidden;
    }}""", "after signing in the page did not show the turns, the charts and live")
    assert not any(TOKEN in u for u in requested)
    cookies = {c["name"]: c for c in d.page.context.cookies()}
    assert cookies["voiceagent_session"]["httpOnly"] and TOKEN not in cookies[
        "voiceagent_session"]["value"]
    assert TOKEN not in log.read_text()
    d.page.context.close()
