"""The engine bench's formats section: each format's measured cost curve and output quality."""

from __future__ import annotations

from llm_engine import formats
from llm_engine.cost_model import CostModel
from llm_engine.runner import TargetRunner
from voiceagent.figures import fmt


def format_section(cost_models: dict[str, CostModel], chosen: str,
                   runners: dict[str, TargetRunner], auto: list[formats.FormatResult],
                   quality: dict[str, formats.Agreement]) -> dict:
    """cost_models and runners: format -> the engine's measured cost model and its runner."""
    return {
        "chosen": chosen,
        "runner": runners[chosen].name,
        "runners": {f: r.name for f, r in runners.items()},
        # Whether a row's logits are independent of the row count: HF's fp32 is treated as so
        # (its differences are ~1e-5 and flip no choice in practice), HF's other formats are not.
        "bit_identical": {f: getattr(r, "bit_identical", r.format == "float32")
                          for f, r in runners.items()},
        "auto": [r.to_dict() for r in auto],
        "cost_models": {f: c.to_dict() for f, c in cost_models.items()},
        "quality": {f: vars(a) for f, a in quality.items()},
    }


def render_formats(section: dict) -> list[str]:
    if not section or not section.get("cost_models"):
        return []
    curves = {f: CostModel.from_dict(c) for f, c in section["cost_models"].items()}
    names = list(curves)
    lines = [
        "## Formats and the measured cost curve", "",
        f"Chosen format: `{section['chosen']}`, runner `{section['runner']}`. One target forward "
        "of r rows over 256 cached tokens (r = 1: a plain step; r = k + 1 verifies k drafts), "
        "measured at load; × 1 row is its cost in plain steps.", "",
        "| rows | " + " | ".join(f"{f} ms | × 1 row" for f in names) + " |",
        "|--:|" + "--:|--:|" * len(names),
    ]
    for r in range(1, max(c.max_rows for c in curves.values()) + 1):
        cols = []
        for c in curves.values():
            ms = c.verify_ms[r - 1] if r <= c.max_rows else None
            cols += [fmt(ms), fmt(ms / c.plain_ms if ms else None, 2)]
        lines.append(f"| {r} | " + " | ".join(cols) + " |")
    lines.append("")
    for name, c in curves.items():
        drafting = ", ".join(
            f"{m} {d.per_token_ms / c.plain_ms:.2f} + {d.fixed_ms / c.plain_ms:.2f} fixed"
            for m, d in c.draft.items())
        if drafting:
            lines.append(f"- drafting cost in {name}, in plain steps per drafted token "
                         f"(+ per proposal): {drafting}")
    for r in section.get("auto", []):
        agree = r["agreement"]
        lines.append(f"- engine.format auto measured {r['format']}: plain step "
                     f"{r['plain_ms']:.1f} ms, {r['tokens_per_s']:.1f} tok/s predicted"
                     + (f", top-1 agreement {agree['top1']:.3f}" if agree else "")
                     + ("" if r["eligible"] else " (below the agreement bound)"))
    lines.append("")
    if section.get("quality"):
        lines += [
            "### Output quality against fp32 (teacher-forced, held-out prompts)", "",
            "| format | top-1 agreement | mean abs. log-prob difference | positions |",
            "|---|--:|--:|--:|",
        ]
        lines += [f"| {f} | {q['top1']:.4f} | {q['mean_abs_logprob_diff']:.4f} | "
                  f"{q['positions']} |" for f, q in section["quality"].items()]
        lines.append("")
    return lines
