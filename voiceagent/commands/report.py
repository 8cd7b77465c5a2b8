"""`voiceagent report`: the latency dashboard's figures as a static HTML or Markdown page with PNG
plots, to share in a review.

Every number comes from `voiceagent.dashboard.stats`, the code behind the dashboard's APIs and
`voiceagent bench call`, so the three agree by construction. The clocks are the turn's three
(`voiceagent.pipeline.clocks` says what each measures). The plots use matplotlib's object API
(`Figure`, drawn by the Agg canvas when saved as PNG). They never touch pyplot, so no display is
needed and no global backend is switched in the process that imports this module.
"""

from __future__ import annotations

import html
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

from voiceagent.commands.turn_audio import draw_turn_audio, parse_turn
from voiceagent.config import Config, store_path
from voiceagent.dashboard.stats import (
    BREAKDOWN,
    by_method,
    ordered,
    overview,
    speculation,
)
from voiceagent.figures import MISSING, fmt, percentile
from voiceagent.pipeline.turn_record import Breakdown, TurnRecord

METHOD_COLOURS = {"off": "#7f7f7f", "ngram": "#1f77b4", "draft": "#ff7f0e", "eagle": "#2ca02c"}
OTHER_COLOURS = ("#9467bd", "#8c564b", "#e377c2")
DPI = 110
WATERFALL_MAX_TURNS = 30

# --since: a duration back from now, or an ISO date/time.
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float) -> float:
    """`24h`, `90m`, `7d` (back from `now`) or an ISO date/time (local time unless it says)."""
    text = text.strip()
    if m := _DURATION.fullmatch(text.lower()):
        return now - float(m[1]) * _UNIT_S[m[2]]
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"--since {text!r} is neither an ISO date/time (2026-11-30, "
                         "2026-11-30T06:00) nor a duration (90m, 24h, 7d)") from None


def when(ts: float) -> str:
    return datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


# Formatting: one definition, used by both renderers (and by the tests to find the numbers).

def fmt_ms(x: float | None) -> str:
    return fmt(x, 1)


def fmt_accepted(x: float | None) -> str:
    return fmt(x, 2)


def fmt_speedup(speedup: dict | None) -> str:
    """`stats.itl_speedup` with the turns each side is over; the "all" column has none."""
    if speedup is None:
        return ""
    return (f"{fmt(speedup['value'], 2, '×')} ({speedup['turns']} vs "
            f"{speedup['off_turns']} off turns)")


def fmt_share(s: dict) -> str:
    share = s["interrupted_share"]
    return MISSING if share is None else f"{share:.1%} ({s['interrupted']})"


# The window's turns, read from the durable store.

@dataclass
class Window:
    store: str  # its file, or its URL without the password
    since: float | None
    now: float
    turns: list[dict]  # TurnRecord dicts, oldest first
    last_call: dict | None  # store.call() of the window's most recent call: {"call", "turns"}


def load_window(cfg: Config, since: float | None, now: float) -> Window:
    from voiceagent.dashboard.store import open_store

    path = store_path(cfg)
    if not cfg.store.url and not path.is_file():
        raise ValueError(f"no turn store at {path}: `voiceagent serve` writes one there; "
                         "choose another with --set store.path=...")
    store = open_store(cfg, retain=False)  # a StoreError (a ValueError) says why not
    try:
        turns = store.turns(since=since)
        last = max(turns, key=lambda t: t["started_at"]) if turns else None
        last_call = store.call(last["call_id"]) if last else None
    finally:
        store.close()
    return Window(store.where, since, now, turns, last_call)


def colour(method: str) -> str:
    if method in METHOD_COLOURS:
        return METHOD_COLOURS[method]
    return OTHER_COLOURS[sum(map(ord, method)) % len(OTHER_COLOURS)]


# Tables.

@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


OVERVIEW_ROWS: tuple[tuple[str, Callable[[dict], str]], ...] = (
    ("turns", lambda s: str(s["turns"])),
    ("calls", lambda s: str(s["calls"])),
    ("turn end → first audio p50 (ms)", lambda s: fmt_ms(s["turn_end_to_first_audio_ms"]["p50"])),
    ("turn end → first audio p95 (ms)", lambda s: fmt_ms(s["turn_end_to_first_audio_ms"]["p95"])),
    ("turn end → first audio p99 (ms)", lambda s: fmt_ms(s["turn_end_to_first_audio_ms"]["p99"])),
    ("request → first token p50 (ms)", lambda s: fmt_ms(s["request_to_first_token_ms"]["p50"])),
    ("request → first token p95 (ms)", lambda s: fmt_ms(s["request_to_first_token_ms"]["p95"])),
    ("inter-token latency p50 (ms)", lambda s: fmt_ms(s["itl_ms"]["p50"])),
    ("inter-token latency p95 (ms)", lambda s: fmt_ms(s["itl_ms"]["p95"])),
    ("inter-token latency p99 (ms)", lambda s: fmt_ms(s["itl_ms"]["p99"])),
    ("inter-token latency mean (ms)", lambda s: fmt_ms(s["itl_ms"]["mean"])),
    ("ITL speed-up over off (mean ITL)", lambda s: fmt_speedup(s.get("itl_speedup"))),
    ("barge-in → silence p50 (ms)", lambda s: fmt_ms(s["barge_in_to_silence_ms"]["p50"])),
    ("barge-in detection p50 (ms)", lambda s: fmt_ms(s["barge_in_detection_ms"]["p50"])),
    ("barge-in stopping p50 (ms)", lambda s: fmt_ms(s["interruption_to_silence_ms"]["p50"])),
    ("accepted tokens / speculative step", lambda s: fmt_accepted(s["accepted_per_step"])),
    ("speculative steps", lambda s: str(s["samples"]["speculative_steps"])),
    ("interrupted share (turns)", fmt_share),
)

BREAKDOWN_LABELS = {
    "vad_hangover_ms": "VAD hangover (turn end → VAD stop)",
    "asr_final_ms": "ASR final (VAD stop → transcript)",
    "prefill_ms": "prefill (inside request → first token)",
    "tool_call_ms": "request → tool call (tool turns)",
    "tools_ms": "tools (tool turns)",
    "first_token_ms": "request → first token",
    "first_clause_ms": "first token → first clause to TTS",
    "tts_first_chunk_ms": "TTS start → first audio chunk",
}


def _columns(ov: dict) -> list[tuple[str, dict]]:
    """(column name, summary): all turns, then each method side by side."""
    return [("all", ov)] + [(m, ov["by_method"][m]) for m in ordered(ov["by_method"])]


def overview_table(ov: dict) -> Table:
    cols = _columns(ov)
    return Table(["", *(name for name, _ in cols)],
                 [[label, *(get(s) for _, s in cols)] for label, get in OVERVIEW_ROWS])


def breakdown_table(ov: dict) -> Table:
    cols = _columns(ov)
    return Table(["median (ms)", *(name for name, _ in cols)],
                 [[BREAKDOWN_LABELS.get(k, k), *(fmt_ms(s["breakdown_p50_ms"][k]) for _, s in cols)]
                  for k in BREAKDOWN])


# Plots: each draws onto an empty Figure and returns False when it has nothing to draw.

def _time_axis(ax) -> None:
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter

    locator = AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))


def plot_clocks(fig, window: Window) -> bool:
    panels = (
        ("turn end → first audio", lambda c: c.turn_end_to_first_audio_ms),
        ("request → first token", lambda c: c.request_to_first_token_ms),
        ("ITL p50 of the turn", lambda c: c.itl_ms.p50),
    )
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (title, get) in zip(axes, panels, strict=True):
        for method, turns in by_method(window.turns).items():
            records = [TurnRecord.from_dict(t) for t in turns]
            points = [(datetime.fromtimestamp(r.started_at), v)
                      for r in records if (v := get(r.clocks)) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.scatter(xs, ys, s=16, color=colour(method), label=method, alpha=0.8)
        ax.set_title(title, loc="left", fontsize=10)
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(title="method", fontsize=8, loc="upper right")
    _time_axis(axes[-1])
    return True


def _grouped_bars(fig, hists: dict[str, list[int]], xlabel: str, ylabel: str) -> bool:
    """One bar group per position, one bar per method, as shares so methods compare."""
    hists = {m: h for m, h in hists.items() if sum(h)}
    if not hists:
        return False
    ax = fig.subplots()
    width = 0.8 / len(hists)
    for i, (method, hist) in enumerate(hists.items()):
        offset = (i - (len(hists) - 1) / 2) * width
        total = sum(hist)
        ax.bar([x + offset for x in range(len(hist))], [c / total for c in hist], width,
               color=colour(method), label=f"{method} (n={total})")
    ax.set_xticks(range(max(len(h) for h in hists.values())))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.yaxis.set_major_formatter(lambda y, _: f"{y:.0%}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(title="method", fontsize=8)
    return True


def plot_accepted(fig, window: Window) -> bool:
    hists = {m: speculation(ts)["accepted_per_step_hist"]
             for m, ts in by_method(window.turns).items()}
    return _grouped_bars(fig, hists, "draft tokens accepted in the step",
                         "share of speculative steps")


def plot_rejections(fig, window: Window) -> bool:
    hists = {m: speculation(ts)["rejection_position_hist"]
             for m, ts in by_method(window.turns).items()}
    return _grouped_bars(fig, hists, "first rejected draft position (0 = first drafted token)",
                         "share of steps with a rejection")


def plot_draft_verify(fig, window: Window) -> bool:
    steps = speculation(window.turns)["steps"]
    if not steps:
        return False
    ax = fig.subplots()
    for s in steps:  # named as stats.method_of names a turn's method
        s["method"] = s["method"] or "unknown"
    for method in ordered(s["method"] for s in steps):
        mine = [s for s in steps if s["method"] == method]
        draft = [s["draft_ms"] for s in mine]
        verify = [s["verify_ms"] for s in mine]
        ax.scatter(draft, verify, s=8, alpha=0.5, color=colour(method),
                   label=f"{method}: {len(mine)} steps, median draft "
                   f"{percentile(draft, 50):.2f} ms, verify {percentile(verify, 50):.1f} ms")
    ax.set_xlabel("drafting (ms per step)")
    ax.set_ylabel("target forward + verification (ms per step)")
    # From the origin, so the two costs read as proportions; a margin keeps the extremes in view.
    ax.set_xlim(0, 1.08 * max(s["draft_ms"] for s in steps) or 1.0)
    ax.set_ylim(0, 1.08 * max(s["verify_ms"] for s in steps) or 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return True


# The waterfall's segments run one after another from the user's turn end to the first audio;
# prefill is split out of request → first token, which contains it.
WATERFALL = (
    ("vad_hangover_ms", "VAD hangover", "#c7c7c7"),
    ("asr_final_ms", "ASR final", "#9edae5"),
    ("transcript_to_request_ms", "transcript → request", "#dbdb8d"),
    ("tool_call_ms", "LLM → tool call", "#c5b0d5"),
    ("tools_ms", "tools", "#9467bd"),
    ("prefill_ms", "prefill", "#1f77b4"),
    ("first_token_after_prefill_ms", "first token after prefill", "#aec7e8"),
    ("first_clause_ms", "first clause", "#ff7f0e"),
    ("tts_first_chunk_ms", "TTS first chunk", "#2ca02c"),
    ("chunk_to_audio_ms", "chunk → audio", "#98df8a"),
)


def waterfall_segments(breakdown: Breakdown) -> dict[str, float]:
    parts = asdict(breakdown)
    first, prefill = parts.get("first_token_ms"), parts.get("prefill_ms")
    parts["first_token_after_prefill_ms"] = (
        max(first - prefill, 0.0) if first is not None and prefill is not None else first)
    return {key: parts.get(key) or 0.0 for key, _, _ in WATERFALL}


def plot_waterfall(fig, window: Window) -> bool:
    turns = (window.last_call or {}).get("turns", [])[-WATERFALL_MAX_TURNS:]
    if not turns:
        return False
    fig.set_size_inches(10, 1.6 + 0.45 * len(turns))
    ax = fig.subplots()
    records = [TurnRecord.from_dict(t) for t in turns]
    labels = [f"turn {r.turn}" + (" (interrupted)" if r.interrupted else "") for r in records]
    left = [0.0] * len(turns)
    segments = [waterfall_segments(r.breakdown) for r in records]
    for key, label, col in WATERFALL:
        widths = [s[key] for s in segments]
        ax.barh(range(len(turns)), widths, left=left, color=col, label=label, height=0.6)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    measured = [(i, v) for i, r in enumerate(records)
                if (v := r.clocks.turn_end_to_first_audio_ms) is not None]
    if measured:
        ys, xs = zip(*measured, strict=True)
        ax.scatter(xs, ys, marker="|", s=400, color="black", zorder=3,
                   label="turn end → first audio (measured)")
    ax.set_yticks(range(len(turns)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the user's turn end")
    ax.grid(axis="x", alpha=0.3)
    fig.legend(fontsize=8, ncols=5, loc="outside lower center")
    return True


@dataclass
class Plot:
    name: str
    title: str
    caption: str
    draw: Callable[[object, Window], bool]
    size: tuple[float, float] = (10, 4.5)
    empty: str = "nothing to plot in the window"


PLOTS = (
    Plot("clocks", "The three clocks over time",
         "One point per turn, coloured by speculation method.", plot_clocks, (10, 8)),
    Plot("accepted", "Accepted tokens per speculative step",
         "Share of each method's speculative steps that accepted n draft tokens.",
         plot_accepted, empty="no speculative steps in the window"),
    Plot("rejections", "Where drafts were rejected",
         "Position of the first rejected draft token, over the steps that rejected one.",
         plot_rejections, empty="no rejected drafts in the window"),
    Plot("draft_verify", "Drafting against verification time, per step",
         "One point per speculative step.", plot_draft_verify,
         empty="no speculative steps in the window"),
    Plot("waterfall", "Where the time went: the most recent call",
         "Stacked breakdown of each turn, from the user's turn end to the first bot audio; the "
         "black tick is the measured clock.", plot_waterfall),
)


def write_plots(window: Window, folder: Path) -> dict[str, Path]:
    """Draw every plot that has data into `folder`; returns name -> PNG path."""
    from matplotlib.figure import Figure

    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for plot in PLOTS:
        path = folder / f"{plot.name}.png"
        path.unlink(missing_ok=True)  # no stale plot from an earlier report
        fig = Figure(figsize=plot.size, layout="constrained")
        if plot.draw(fig, window):
            fig.savefig(path, dpi=DPI)
            written[plot.name] = path
    return written


# The document: sections rendered by either renderer.

@dataclass
class Section:
    heading: str
    text: str = ""
    table: Table | None = None
    image: str | None = None  # a relative URL


@dataclass
class Report:
    title: str
    facts: list[tuple[str, str]]
    sections: list[Section] = field(default_factory=list)


def build_report(cfg: Config, window: Window, plots: dict[str, Path], out_dir: Path) -> Report:
    spec = cfg.engine.speculation
    config = f"target {cfg.engine.target}, speculation {spec.method}"
    if spec.method == "draft" and cfg.engine.draft:
        config += f" (draft {cfg.engine.draft})"
    if spec.method == "eagle" and cfg.engine.eagle:
        config += f" (EAGLE head {cfg.engine.eagle})"
    if window.since is not None:
        start = when(window.since)
    else:
        start = f"all turns (first {when(window.turns[0]['started_at'])})" if window.turns \
            else "all turns"
    ov = overview(window.turns)
    facts = [
        ("Window", f"{start} → {when(window.now)}"),
        ("Calls", str(ov["calls"])),
        ("Turns", f"{ov['turns']} ({ov['interrupted']} interrupted)"),
        ("Config", config),
        ("Store", window.store),
        ("Generated", when(time.time())),
    ]
    report = Report("Voice agent latency report", facts)
    if not window.turns:
        report.sections.append(Section("Overview", "No turns in the window."))
        return report
    report.sections += [
        Section("Overview", "All turns, and each speculation method side by side (the A/B "
                "view). ITL percentiles and mean pool every inter-token gap, and the speed-up "
                "is off's mean ITL over the method's (with the turns each side is over); "
                "accepted tokens per step pools every speculative step; the other clocks are "
                "one value per turn.", table=overview_table(ov)),
        Section("Median breakdown", "Median of each part of the turn, per method.",
                table=breakdown_table(ov)),
    ]
    for plot in PLOTS:
        heading = plot.title
        if plot.name == "waterfall" and window.last_call:
            call = window.last_call["call"]
            heading += f" ({call['call_id']}, {call['kind']}, {when(call['started_at'])})"
        if plot.name in plots:
            src = quote(plots[plot.name].relative_to(out_dir).as_posix())
            report.sections.append(Section(heading, plot.caption, image=src))
        else:
            report.sections.append(Section(heading, f"Not drawn: {plot.empty}."))
    report.sections.append(Section(
        "About these numbers", "Computed by voiceagent.dashboard.stats, the same code as the "
        "dashboard and `voiceagent bench call`; percentiles are linear-interpolated."))
    return report


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(report: Report) -> str:
    lines = [f"# {report.title}", ""]
    lines += [f"- **{label}:** {_md_cell(value)}" for label, value in report.facts]
    for s in report.sections:
        lines += ([] if lines[-1] == "" else [""]) + [f"## {s.heading}", ""]
        if s.text:
            lines += [s.text, ""]
        if s.table:
            lines.append("| " + " | ".join(map(_md_cell, s.table.header)) + " |")
            lines.append("|---|" + "--:|" * (len(s.table.header) - 1))
            lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in s.table.rows]
            lines.append("")
        if s.image:
            lines += [f"![{s.heading}]({s.image})", ""]
    return "\n".join(lines).rstrip() + "\n"


CSS = """
body { font: 14px/1.45 system-ui, sans-serif; max-width: 1000px; margin: 2em auto;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
dl { display: grid; grid-template-columns: max-content auto; gap: .2em 1em; }
dt { font-weight: 600; } dd { margin: 0; }
table { border-collapse: collapse; margin: .5em 0; }
th, td { padding: .3em .8em; border-bottom: 1px solid #e4e4e4; }
td { text-align: right; font-variant-numeric: tabular-nums; }
td:first-child, th:first-child { text-align: left; }
th { background: #f4f4f4; }
img { max-width: 100%; border: 1px solid #eee; }
p { color: #555; }
"""


def render_html(report: Report) -> str:
    e = html.escape
    out = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{e(report.title)}</title><style>{CSS}</style></head><body>",
           f"<h1>{e(report.title)}</h1>", "<dl>"]
    out += [f"<dt>{e(label)}</dt><dd>{e(value)}</dd>" for label, value in report.facts]
    out.append("</dl>")
    for s in report.sections:
        out.append(f"<h2>{e(s.heading)}</h2>")
        if s.text:
            out.append(f"<p>{e(s.text)}</p>")
        if s.table:
            out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in s.table.header)
                       + "</tr>")
            out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>"
                    for row in s.table.rows]
            out.append("</table>")
        if s.image:
            out.append(f'<img src="{e(s.image)}" alt="{e(s.heading)}">')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


RENDERERS = {".html": render_html, ".md": render_markdown}


def run_report(cfg: Config, args) -> int:
    out = Path(args.out)
    render = RENDERERS.get(out.suffix.lower())
    if render is None:
        raise ValueError(f"--out {out}: the report is written as .html or .md, "
                         "chosen by the extension")
    now = time.time()
    since = parse_since(args.since, now) if args.since else None
    window = load_window(cfg, since, now)
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = out.parent / f"{out.stem}_files"
    plots = write_plots(window, folder) if window.turns else {}
    report = build_report(cfg, window, plots, out.parent)
    for call_id, n in (parse_turn(text) for text in args.turn):
        folder.mkdir(parents=True, exist_ok=True)
        png = folder / f"turn-{call_id}-{n}.png"
        caption = draw_turn_audio(cfg, call_id, n, png, DPI)
        src = quote(png.relative_to(out.parent).as_posix())
        report.sections.insert(-1, Section(f"Turn {n} of call {call_id}, as heard", caption,
                                           image=src))
    out.write_text(render(report))
    note = f"{len(plots)} plot(s) in {folder}" if window.turns else "no turns in the window"
    print(f"wrote {out} ({note})")
    return 0
