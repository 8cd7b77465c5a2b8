"""`voiceagent bench serve --knee`: the capacity knee: how many calls at once before latency bends.

1, 2, 3 ... N simulated Twilio callers at once (from a process of their own, `callers.py`),
speculation off and on, each a conversation of `turns` questions at real-time pace, started a
little apart as real callers are. Per N: clock 3 p50/p95, ITL p95, each stage's p50, calls
refused by the admission limit (`server.max_calls`, close 1013), and how many conversations
stayed within the latency threshold (every turn's clock 3 under it). The knee
is the most calls the server ran at once with at least `KEEP_SHARE` of them within it: callers it
refused are not counted against it, nor as served. Run it with `server.max_calls` at the largest N
to find where the machine bends.

A level's figures move by about a fifth between runs on a shared 2-core machine; `passes` runs
every level that many times, the methods alternating, and pools each level's turns.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from voiceagent.bench.callers import call_from_another_process
from voiceagent.config import Config
from voiceagent.dashboard.stats import BREAKDOWN, summarise
from voiceagent.figures import fmt, percentile
from voiceagent.logs import progress_bar
from voiceagent.server.serve import serving_in_process

KEEP_SHARE = 0.9
STAGGER_S = 0.3  # between callers' starts


def variants(methods: list[str], compare_shared: bool) -> list[tuple[str, str, bool]]:
    """(label, method, shared forwards) for each method; with `compare_shared`, each method once
    with one engine forward per call in turn (the engine before shared forwards) and once
    shared."""
    if not compare_shared:
        return [(m, m, True) for m in methods]
    return [(f"{m}{suffix}", m, on) for m in methods
            for suffix, on in ((" (forward each)", False), (" (shared forward)", True))]


async def knee(cfg: Config, shared, audio: list, callers: list[int],
               runs: list[tuple[str, str, bool]], threshold_ms: float, say,
               passes: int = 1) -> dict:
    with tempfile.TemporaryDirectory(prefix="knee-") as tmp:
        clips = []
        for i, speech in enumerate(audio):  # the callers' process reads them
            clips.append(Path(tmp) / f"{i}.npy")
            np.save(clips[-1], speech)
        return await _knee(cfg, shared, clips, callers, runs, threshold_ms, say, passes)


async def _knee(cfg: Config, shared, audio: list[Path], callers: list[int],
                runs: list[tuple[str, str, bool]], threshold_ms: float, say,
                passes: int) -> dict:
    # per (method, callers): every pass's outcomes and calls
    pooled = {(label, n): ([], []) for label, _, _ in runs for n in callers}
    bar = progress_bar(passes * len(runs) * len(callers), "bench serve --knee", "level")
    engine = shared.worker.engine if shared.worker is not None else None
    for label, method, shared_forwards in [run for _ in range(passes) for run in runs]:
        run_cfg = cfg.model_copy(deep=True)
        run_cfg.engine.speculation.method = method
        run_cfg.engine.shared_forwards = shared_forwards  # what this variant's turns record
        if engine is not None:
            engine.shared_forwards = shared_forwards
        async with serving_in_process(run_cfg, shared) as (app, base):
            url = base.replace("http://", "ws://") + "/telephony/twilio"
            records = app.state.server.records
            await call_from_another_process(url, audio[:1], 1, 0)  # warm-up, not counted
            # a call's slot is free once its pipeline has ended: no level is refused for the
            # calls before it, and each level's records are complete
            await app.state.server.calls.wait_idle()
            for n in callers:
                say(f"knee: {label}, {n} caller(s) at once")
                before = set(records.by_call)
                outcomes = await call_from_another_process(url, audio, n, STAGGER_S)
                await app.state.server.calls.wait_idle()
                pooled[label, n][0].extend(outcomes)
                pooled[label, n][1].extend(records.by_call[c] for c in records.by_call
                                           if c not in before)
                bar.update()
    bar.close()
    levels = [level(label, n, *pooled[label, n], threshold_ms)
              for label, _, _ in runs for n in callers]
    return {"threshold_ms": threshold_ms, "max_calls": cfg.server.max_calls,
            "turns": len(audio), "passes": passes, "levels": levels,
            "knee": {label: knee_of([lv for lv in levels if lv["method"] == label])
                     for label, _, _ in runs}}


def level(method: str, n: int, outcomes: list[str], calls: list, threshold_ms: float) -> dict:
    """A number of callers at once over one pass or several: `outcomes` (n a pass, in pass
    order) and `calls` of every pass. Refused and within count every pass; admitted is per
    pass."""
    refused_per_pass = [outcomes[i:i + n].count("refused") for i in range(0, len(outcomes), n)]
    refused = sum(refused_per_pass)
    clock3 = [t.clocks.turn_end_to_first_audio_ms for turns in calls for t in turns]
    itl95 = [t.clocks.itl_ms.p95 for turns in calls for t in turns if t.clocks.itl_ms.p95]
    within = sum(1 for turns in calls if turns and all(
        t.clocks.turn_end_to_first_audio_ms is not None
        and t.clocks.turn_end_to_first_audio_ms <= threshold_ms for t in turns))
    return {
        "method": method, "callers": n, "refused": refused, "failed": outcomes.count("failed"),
        "admitted": n - max(refused_per_pass, default=0),  # at once, in the pass that refused most
        "served": len(outcomes) - refused,  # conversations over the passes
        "within": within,
        "clock3_p50_ms": percentile([c for c in clock3 if c is not None], 50),
        "clock3_p95_ms": percentile([c for c in clock3 if c is not None], 95),
        "itl_p95_ms": percentile(itl95, 95),
        # where the wait went: each stage's p50 over the level's turns (the dashboard's figure)
        "breakdown_p50_ms": summarise([t.to_dict() for turns in calls
                                       for t in turns])["breakdown_p50_ms"],
    }


def knee_of(levels: list[dict]) -> int:
    """The most calls admitted at once of which at least KEEP_SHARE stayed within the
    threshold (over all passes) and none failed; 0 if no level did."""
    good = [lv["admitted"] for lv in levels
            if lv["admitted"] and not lv["failed"]
            and lv["within"] >= KEEP_SHARE * lv["served"]]
    return max(good, default=0)


def render_knee(r: dict) -> str:
    def ms(v):
        return fmt(v, 0)

    passes = r.get("passes", 1)
    pooled = f" Each level ran {passes} times, the methods alternating; its turns are pooled." \
        if passes > 1 else ""
    lines = [f"Threshold: clock 3 ≤ {r['threshold_ms']:.0f} ms on every turn of a "
             f"{r['turns']}-turn conversation; admission limit server.max_calls = "
             f"{r['max_calls']}.{pooled}", "",
             "| method | callers at once | admitted | refused | failed | clock 3 p50 | "
             "clock 3 p95 | ITL p95 | within threshold |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for lv in r["levels"]:
        lines.append(f"| {lv['method']} | {lv['callers']} | {lv['admitted']} | {lv['refused']} | "
                     f"{lv['failed']} | {ms(lv['clock3_p50_ms'])} | {ms(lv['clock3_p95_ms'])} | "
                     f"{ms(lv['itl_p95_ms'])} | {lv['within']}/{lv['served']} |")
    stages = [k for k in BREAKDOWN
              if any(lv.get("breakdown_p50_ms", {}).get(k) is not None for lv in r["levels"])]
    lines += ["", "Where clock 3 went, each stage's p50 (ms):", "",
              "| method | callers at once | " + " | ".join(s.removesuffix("_ms") for s in stages)
              + " |", "|---|--:|" + "--:|" * len(stages)]
    for lv in r["levels"]:
        got = lv.get("breakdown_p50_ms", {})
        lines.append(f"| {lv['method']} | {lv['callers']} | "
                     + " | ".join(ms(got.get(k)) for k in stages) + " |")
    lines += ["", "Knee (most calls served at once with ≥ "
              f"{KEEP_SHARE:.0%} of conversations within the threshold): "
              + ", ".join(f"{m} {k}" for m, k in r["knee"].items())]
    return "\n".join(lines)
