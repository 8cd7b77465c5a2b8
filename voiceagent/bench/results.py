"""Pure aggregation for `voiceagent bench engine`: run records in, summary and Markdown out.

Nothing here touches a model or a clock, so the tests feed it hand-made numbers. Conventions:

- A run's token times are ms since the request started; tokens committed by one step share a
  time, so their inter-token latencies are 0 (the engine's `RequestStats` convention).
- Decode rate: tokens after the first over the time from the first to the last token. End to end:
  all tokens over the time to the last one, which includes the first token (prefill).
- Ratios between modes are taken per prompt pair (same temperature, repeat, segment and prompt,
  measured minutes apart at most on a noisy machine), then summarised by their geometric mean.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path

from llm_engine.stats import decode_rate
from voiceagent.figures import fmt, percentile

REFERENCE = "off"  # the mode every ratio and the losslessness check compare against
FORMAT_MARK = "@"  # "ngram@float32": a mode run in a format other than the engine's chosen one
ANCHOR = "anchor"  # an OpenAI-compatible server timed on the same prompts (--anchor-url)


def is_baseline(mode: str) -> bool:
    """Not one of our engine's modes: a Hugging Face generate() baseline or the anchor server."""
    return mode.startswith("hf_") or mode == ANCHOR


def reference_for(mode: str) -> str:
    """The `off` a mode is compared with: the one in its own weight format."""
    _, at, fmt = mode.partition(FORMAT_MARK)
    return f"{REFERENCE}{FORMAT_MARK}{fmt}" if at else REFERENCE


def is_reference(mode: str) -> bool:
    return mode == reference_for(mode)
# (faster mode, slower-or-equal baseline) pairs for ratio (c): our proposer against HF's.
SAME_PROPOSER = (("ngram", "hf_prompt_lookup"), ("draft", "hf_assisted"))


@dataclass
class RunRecord:
    """One generation by one mode, as measured."""

    mode: str
    engine: bool  # our engine (True) or a Hugging Face generate() baseline
    segment: str
    prompt_index: int
    repeat: int
    temperature: float
    prompt_tokens: int
    token_ids: list[int]
    token_times_ms: list[float]  # per token, ms since the request started
    # Target forward passes, prefill included. Engine: decode steps + 1. HF: one per streamer put
    # (plain: prefill, then one per token; assisted loops verify a draft in every forward, the
    # first one included), so tokens per forward compares every mode.
    forwards: int = 0
    steps: int = 0  # engine decode steps after the prefill (speculative or plain)
    speculative_steps: int = 0  # steps that drafted at least one token (engine only)
    accepted: int = 0  # accepted draft tokens over the speculative steps (engine only)
    drafted_by_pos: list[int] = field(default_factory=list)
    accepted_by_pos: list[int] = field(default_factory=list)
    draft_ms: float | None = None  # summed over steps (engine only)
    verify_ms: float | None = None
    gated_off: bool = False
    finish_reason: str | None = None
    engine_stats: dict | None = None  # the engine's full RequestStats.to_dict()
    # Tool-call prompts only: the call parsed from the reply, and whether it names one of the
    # prompt's tools with arguments valid under that tool's parameters.
    tool_call: dict | None = None
    schema_valid: bool | None = None

    @property
    def key(self) -> tuple[float, int, str, int]:
        """Identifies the prompt measurement that runs of different modes share."""
        return (self.temperature, self.repeat, self.segment, self.prompt_index)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ttft_ms(self) -> float | None:
        return self.token_times_ms[0] if self.token_times_ms else None

    @property
    def itl_ms(self) -> list[float]:
        return [b - a for a, b in pairwise(self.token_times_ms)]

    @property
    def decode_tok_s(self) -> float | None:
        return decode_rate(self.token_times_ms)

    @property
    def e2e_tok_s(self) -> float | None:
        t = self.token_times_ms
        if not t or t[-1] <= 0:
            return None
        return len(t) * 1000.0 / t[-1]


# -- small statistics ---------------------------------------------------------------------------


def geomean(values: Iterable[float]) -> float | None:
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    if any(v <= 0 for v in xs):
        raise ValueError("geometric mean of non-positive values")
    return math.exp(sum(math.log(v) for v in xs) / len(xs))


def ratio_list(num: list[int], den: list[int]) -> list[float]:
    """Element-wise num / den, for acceptance by draft position."""
    return [a / b for a, b in zip(num, den, strict=True) if b]


def add_lists(parts: Iterable[list[int]]) -> list[int]:
    total: list[int] = []
    for part in parts:
        total.extend([0] * (len(part) - len(total)))
        for i, value in enumerate(part):
            total[i] += value
    return total


# -- pairing runs across modes ------------------------------------------------------------------


def paired_ratios(
    records: list[RunRecord], mode: str, baseline: str, metric: str = "decode_tok_s"
) -> list[float]:
    """mode's metric over baseline's metric, one value per prompt measured by both."""
    base = {r.key: getattr(r, metric) for r in records if r.mode == baseline}
    out = []
    for r in records:
        if r.mode != mode or r.key not in base:
            continue
        a, b = getattr(r, metric), base[r.key]
        if a and b:
            out.append(a / b)
    return out


def paired_geomean(
    records: list[RunRecord], mode: str, baseline: str, metric: str = "decode_tok_s"
) -> float | None:
    return geomean(paired_ratios(records, mode, baseline, metric))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


WHY_INFORMATIVE = {ANCHOR: "its streamed text, re-tokenised"}


def lossless_check(records: list[RunRecord], rounding: Collection[str] = ()) -> dict[str, dict]:
    """At temperature 0, every mode's tokens against `off`'s for the same prompt.

    Engine modes must match exactly (the check); HF modes are informative, because HF's batched
    verification and our kernels may round differently and flip a near tie. So are the modes in
    `rounding`: a format (bf16 on a CPU) whose kernels round differently for different numbers of
    rows, so that a verify of k + 1 rows and a plain step of one can disagree on a near tie.
    """
    greedy = [r for r in records if r.temperature == 0]
    ref = {(r.mode, r.key): r.token_ids for r in greedy if r.engine and is_reference(r.mode)}
    out: dict[str, dict] = {}
    for r in greedy:
        base = (reference_for(r.mode), r.key)
        if (r.engine and is_reference(r.mode)) or base not in ref:
            continue
        entry = out.setdefault(r.mode, {
            "checked": r.engine and r.mode not in rounding, "compared": 0, "mismatches": 0,
            "first_diff": [], "why": WHY_INFORMATIVE.get(r.mode)
            or ("rounding by row count" if r.mode in rounding else None),
        })
        entry["compared"] += 1
        diff = first_difference(r.token_ids, ref[base])
        if diff is not None:
            entry["mismatches"] += 1
            entry["first_diff"].append(
                {"segment": r.segment, "prompt": r.prompt_index, "repeat": r.repeat, "at": diff}
            )
    return out


# -- per-cell summary ---------------------------------------------------------------------------


def summarise_cell(runs: list[RunRecord], all_records: list[RunRecord]) -> dict:
    """One (temperature, segment, mode) cell: rates, latencies, acceptance, step times."""
    first = runs[0]
    decode_tokens = sum(max(r.n_tokens - 1, 0) for r in runs)
    decode_ms = sum(r.token_times_ms[-1] - r.token_times_ms[0] for r in runs if r.token_times_ms)
    last_ms = sum(r.token_times_ms[-1] for r in runs if r.token_times_ms)
    itl = [x for r in runs for x in r.itl_ms]
    steps = sum(r.steps for r in runs)
    forwards = sum(r.forwards for r in runs)
    spec_steps = sum(r.speculative_steps for r in runs)
    same_cell = [
        r for r in all_records if r.temperature == first.temperature and r.segment == first.segment
    ]
    engine_times = first.engine and steps > 0
    reference = reference_for(first.mode)
    pairs = paired_ratios(same_cell, first.mode, reference)
    checked = [r.schema_valid for r in runs if r.schema_valid is not None]
    return {
        "temperature": first.temperature,
        "segment": first.segment,
        "mode": first.mode,
        "engine": first.engine,
        "runs": len(runs),
        "mean_tokens": sum(r.n_tokens for r in runs) / len(runs),
        "decode_tok_s": decode_tokens * 1000.0 / decode_ms if decode_ms > 0 else None,
        "e2e_tok_s": sum(r.n_tokens for r in runs) * 1000.0 / last_ms if last_ms > 0 else None,
        "ratio_vs_off": geomean(pairs),
        "ratio_vs_off_range": [min(pairs), max(pairs)] if pairs else None,
        "e2e_ratio_vs_off": paired_geomean(same_cell, first.mode, reference, "e2e_tok_s"),
        "ttft_ms_p50": percentile([r.ttft_ms for r in runs if r.ttft_ms is not None], 50),
        "itl_ms_p50": percentile(itl, 50),
        "itl_ms_p95": percentile(itl, 95),
        "itl_ms_p99": percentile(itl, 99),
        "tokens_per_forward": sum(r.n_tokens for r in runs) / forwards if forwards else None,
        "accepted_per_step": sum(r.accepted for r in runs) / spec_steps if spec_steps else None,
        "acceptance_by_pos": ratio_list(
            add_lists(r.accepted_by_pos for r in runs), add_lists(r.drafted_by_pos for r in runs)
        ),
        "draft_ms_per_step": sum(r.draft_ms or 0.0 for r in runs) / steps if engine_times else None,
        "verify_ms_per_step": (
            sum(r.verify_ms or 0.0 for r in runs) / steps if engine_times else None
        ),
        "gated_off_runs": sum(r.gated_off for r in runs),
        "schema_checked": len(checked),  # tool calls checked against their tool's schema
        "schema_valid": sum(checked) / len(checked) if checked else None,  # their valid share
    }


def summarise(records: list[RunRecord], modes: list[str], rounding: Collection[str] = ()) -> dict:
    """Cells per temperature × segment × mode (in `modes` order), ratios (a)(b)(c), losslessness."""
    temperatures = sorted({r.temperature for r in records})
    segments = list(dict.fromkeys(r.segment for r in records))
    cells = []
    for t in temperatures:
        for seg in segments:
            for mode in modes:
                runs = [r for r in records if (r.temperature, r.segment, r.mode) == (t, seg, mode)]
                if runs:
                    cells.append(summarise_cell(runs, records))
    return {
        "cells": cells,
        "ratios": ratios(records, modes, temperatures, segments),
        "lossless": lossless_check(records, rounding),
    }


def ratios(
    records: list[RunRecord], modes: list[str], temperatures: list[float], segments: list[str]
) -> dict:
    """(a) off ÷ HF plain; (b) best speculative ÷ off at T=0; (c) ours ÷ HF's same proposer;
    (d) the slowest mode against its own off; (e) the anchor server ÷ off.

    Each is a geometric mean of per-prompt decode-rate ratios, per segment and over all prompts
    ("all"); (a) also carries the end-to-end ratio, which includes the first token.
    """

    def per_segment(t: float, mode: str, base: str, metric: str = "decode_tok_s") -> dict:
        at_t = [r for r in records if r.temperature == t]
        out = {seg: paired_geomean([r for r in at_t if r.segment == seg], mode, base, metric)
               for seg in segments}
        out["all"] = paired_geomean(at_t, mode, base, metric)
        return out

    a, c, d, e = {}, {}, {}, {}
    plain_modes = [m for m in modes if m.startswith(REFERENCE) and is_reference(m)]
    for t in temperatures:
        if "hf_plain" in modes:
            a[str(t)] = {
                "decode": per_segment(t, REFERENCE, "hf_plain"),
                "e2e": per_segment(t, REFERENCE, "hf_plain", "e2e_tok_s"),
                "by_format": {m: per_segment(t, m, "hf_plain")["all"] for m in plain_modes},
            }
        slowest = [
            (value, mode, seg)
            for mode in modes if not is_reference(mode) and not is_baseline(mode)
            for seg, value in per_segment(t, mode, reference_for(mode)).items()
            if value is not None and seg != "all"
        ]
        if slowest:
            value, mode, seg = min(slowest)
            d[str(t)] = {"ratio": value, "mode": mode, "segment": seg}
        if ANCHOR in modes:
            e[str(t)] = per_segment(t, ANCHOR, REFERENCE)
        c[str(t)] = {
            f"{ours}/{theirs}": per_segment(t, ours, theirs)
            for ours, theirs in SAME_PROPOSER
            if ours in modes and theirs in modes
        }
    b: dict = {}
    speculative = [m for m in modes
                   if m != REFERENCE and not is_baseline(m) and FORMAT_MARK not in m]
    if 0.0 in temperatures and speculative:
        by_mode = {m: per_segment(0.0, m, REFERENCE) for m in speculative}
        for seg in [*segments, "all"]:
            scored = {m: by_mode[m][seg] for m in speculative if by_mode[m][seg] is not None}
            best = max(scored, key=scored.get) if scored else None
            b[seg] = {"best_mode": best, "best": scored.get(best), "by_mode": scored}
    return {"a_off_vs_hf_plain": a, "b_best_speculative_vs_off_t0": b, "c_vs_hf_same_proposer": c,
            "d_slowest_vs_own_off": d, "e_anchor_vs_off": e}


# -- Markdown -----------------------------------------------------------------------------------


def _ratio(c: dict) -> str:
    """× off: 1 for a reference, else the geometric mean and, over several runs, the range."""
    if is_reference(c["mode"]):
        return "1"
    spread = c["ratio_vs_off_range"]
    brackets = f" ({spread[0]:.2f}–{spread[1]:.2f})" if spread and c["runs"] > 1 else ""
    return fmt(c["ratio_vs_off"], 2) + brackets


def _cell_row(c: dict) -> str:
    by_pos = " ".join(f"{x:.2f}".lstrip("0") for x in c["acceptance_by_pos"][:4]) or "–"
    step_ms = (
        "–" if c["draft_ms_per_step"] is None
        else f"{c['draft_ms_per_step']:.1f} / {c['verify_ms_per_step']:.1f}"
    )
    cols = [
        c["segment"], c["mode"], fmt(c["mean_tokens"], 0), fmt(c["decode_tok_s"]),
        fmt(c["e2e_tok_s"]), _ratio(c), fmt(c["ttft_ms_p50"], 0), fmt(c["itl_ms_p50"], 0),
        fmt(c["itl_ms_p95"], 0), fmt(c["itl_ms_p99"], 0), fmt(c["tokens_per_forward"], 2),
        fmt(c["accepted_per_step"], 2), by_pos, step_ms, str(c["gated_off_runs"]),
    ]
    return "| " + " | ".join(cols) + " |"


CELL_HEADER = (
    "| segment | mode | tokens | tok/s | e2e tok/s | × off | TTFT ms | ITL p50 | ITL p95 | "
    "ITL p99 | tok/fwd | acc/step | acc by pos | draft / verify ms | gated |\n"
    "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|"
)


LEGEND = (
    "tok/s: decode rate after the first token; e2e includes the first token. "
    "× off: geometric mean of per-prompt decode-rate ratios (their range in brackets), against "
    "the off of the mode's own format (mode@format: a format other than the chosen one). "
    "ITL in ms (tokens of one step count 0). "
    "tok/fwd: tokens per target forward pass, prefill included. "
    "acc/step: accepted drafts per speculative step. "
    "draft / verify: engine ms per decode step. "
    "gated: runs where the cost gate closed."
)


TOOL_CALL_HEADER = (
    "| mode | T | tok/s | tok/fwd | × off | schema-valid |\n|---|--:|--:|--:|--:|--:|"
)

TOOL_CALL_LEGEND = (
    "Every mode, off included, decodes these prompts under the tools grammar with tool_choice "
    "required; the HF baselines and the anchor, which cannot, skip them. schema-valid: calls "
    "that name one of the prompt's tools with arguments valid under its parameters (jsonschema), "
    "of the runs; a call cut off by the budget counts as invalid. tok/s, tok/fwd, × off: as above."
)


def render_markdown(summary: dict, header: list[str], extra: list[str] = ()) -> str:
    """The report: one table per temperature, the tool-call tables, then ratios (a)-(e), the
    losslessness check and `extra` sections."""
    lines = ["# Engine benchmark", "", *header, ""]
    temperatures = list(dict.fromkeys(c["temperature"] for c in summary["cells"]))
    for t in temperatures:
        lines += [f"## Temperature {t:g}", "", CELL_HEADER]
        lines += [_cell_row(c) for c in summary["cells"] if c["temperature"] == t]
        lines.append("")
    lines += [LEGEND, ""]
    lines += _tool_call_lines(summary["cells"])
    lines += _ratio_lines(summary["ratios"])
    lines += _lossless_lines(summary["lossless"])
    lines += extra
    return "\n".join(lines).rstrip() + "\n"


def _tool_call_lines(cells: list[dict]) -> list[str]:
    """One table per tool-call segment: speed and the share of schema-valid calls per mode."""
    checked = [c for c in cells if c.get("schema_checked")]
    lines = []
    for segment in dict.fromkeys(c["segment"] for c in checked):
        lines += [f"## Tool calls: {segment}", "", TOOL_CALL_HEADER]
        lines += [_tool_call_row(c) for c in checked if c["segment"] == segment]
        lines.append("")
    return [*lines, TOOL_CALL_LEGEND, ""] if lines else []


def _tool_call_row(c: dict) -> str:
    valid = f"{c['schema_valid']:.0%} of {c['schema_checked']}"
    cols = [c["mode"], f"{c['temperature']:g}", fmt(c["decode_tok_s"]),
            fmt(c["tokens_per_forward"], 2), _ratio(c), valid]
    return "| " + " | ".join(cols) + " |"


def _ratio_lines(r: dict) -> list[str]:
    bullets = []
    for t, entry in r["a_off_vs_hf_plain"].items():
        bullets.append(
            f"(a) engine off ÷ HF generate() plain, T={float(t):g}: {_seg_list(entry['decode'])};"
            f" end to end, all prompts: {fmt(entry['e2e']['all'], 2)}"
        )
        others = {m: v for m, v in entry.get("by_format", {}).items() if m != REFERENCE}
        if others:
            bullets.append(f"(a) each format's off ÷ HF generate() plain (fp32), T={float(t):g}: "
                           + ", ".join(f"{m} {fmt(v, 2)}" for m, v in others.items()))
    b = r["b_best_speculative_vs_off_t0"]
    if b:
        bullets.append("(b) best speculative mode ÷ off, T=0: " + ", ".join(
            f"{seg} {fmt(v['best'], 2)} ({v['best_mode'] or '–'})" for seg, v in b.items()
        ))
    for t, worst in r.get("d_slowest_vs_own_off", {}).items():
        bullets.append(f"(d) slowest mode ÷ the off of its format, any segment, T={float(t):g}: "
                       f"{fmt(worst['ratio'], 2)} ({worst['mode']}, {worst['segment']})")
    for t, pairs in r["c_vs_hf_same_proposer"].items():
        for pair, values in pairs.items():
            bullets.append(f"(c) {pair.replace('/', ' ÷ ')}, T={float(t):g}: {_seg_list(values)}")
    for t, values in r.get("e_anchor_vs_off", {}).items():
        bullets.append(f"(e) anchor server ÷ engine off, T={float(t):g}: {_seg_list(values)}")
    if not bullets:
        return []
    title = "## Ratios (geometric mean of per-prompt decode tok/s ratios)"
    return [title, "", *(f"- {line}" for line in bullets), ""]


def _seg_list(values: dict) -> str:
    return ", ".join(f"{seg} {fmt(v, 2)}" for seg, v in values.items())


def _lossless_lines(lossless: dict) -> list[str]:
    if not lossless:
        return []
    lines = ["## Losslessness at temperature 0 (token ids against `off`, same prompt)", "",
             "| mode | kind | compared | mismatches | first differing token |",
             "|---|---|--:|--:|---|"]
    for mode, e in lossless.items():
        kind = "must match" if e["checked"] else f"informative{_why(e)}"
        where = ", ".join(
            f"{d['segment']} #{d['prompt'] + 1} at {d['at']}" for d in e["first_diff"]
        ) or "–"
        lines.append(f"| {mode} | {kind} | {e['compared']} | {e['mismatches']} | {where} |")
    return [*lines, ""]


def _why(entry: dict) -> str:
    return f" ({entry['why']})" if entry.get("why") else ""


def utc_stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def save_results(out: str | Path, name: str, stamp: str, markdown: str, data: dict) -> None:
    """Write <out>/<name>-<stamp>.md and .json, and print the Markdown."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-{stamp}.md").write_text(markdown)
    (out / f"{name}-{stamp}.json").write_text(json.dumps(data, indent=1, ensure_ascii=False))
    print(markdown)
