"""`voiceagent bench cue`: the turn cue's scores on labelled phrases, for the configured target.

`turn.unfinished_logprob` is a threshold on one model's probabilities: a different target (a
bigger model on a GPU) scores the same words differently. This scores phrases callers say,
labelled finished or unfinished (configs/prompts/turn_cue_v1.yaml), through the pipeline's own
`UtteranceEnd`, and reports which the configured threshold gets wrong, and for a sweep of
thresholds the two ways to be wrong: a finished message held (it waits
`turn.unfinished_hold_s` more) and a fragment let end (the bot starts inside the caller's
sentence if they go on). Which weighs more is the operator's choice. Phrases whose words alone
hold the turn (`turns.ending`: a last word like "and" or "is", a trailing comma, digits) are
scored but not counted: the turn waits whatever the score.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import yaml

from llm_engine.serving import EngineWorker
from voiceagent.bench.results import save_results, utc_stamp
from voiceagent.config import Config
from voiceagent.figures import fmt, percentile
from voiceagent.llm_setup import build_runtime
from voiceagent.pipeline.turns import UNFINISHED, ending
from voiceagent.pipeline.utterance_end import UtteranceEnd, normalise

DEFAULT_PHRASES = Path(__file__).resolve().parents[2] / "configs" / "prompts" / "turn_cue_v1.yaml"
LABELS = ("finished", "unfinished")


def load_phrases(path: str | Path) -> dict[str, list[str]]:
    data = yaml.safe_load(Path(path).read_text())
    phrases = {label: [str(p) for p in data.get(label) or []] for label in LABELS}
    if not all(phrases.values()):
        raise ValueError(f"{path}: needs both a `finished` and an `unfinished` list")
    return phrases


def run_cue_bench(cfg: Config, args) -> int:
    threshold = cfg.turn.unfinished_logprob
    phrases = load_phrases(args.phrases or DEFAULT_PHRASES)
    worker, runtime = EngineWorker.build(
        lambda: build_runtime(cfg.engine, cfg.paths.cache_dir))
    try:
        rows = asyncio.run(_score_all(worker, runtime.target.tokenizer, phrases))
    finally:
        worker.close()
    summary = summarise(rows, threshold)
    stamp = utc_stamp()
    markdown = (f"# Turn cue benchmark\n\n- {stamp}, target `{cfg.engine.target}` "
                f"({runtime.engine.runner.format}), {len(rows)} phrases "
                f"({Path(args.phrases or DEFAULT_PHRASES).name}), threshold "
                f"`turn.unfinished_logprob` {threshold}\n\n" + render(rows, summary) + "\n")
    save_results(args.out, "cue", stamp, markdown, {"summary": summary, "rows": rows})
    return 0


async def _score_all(worker: EngineWorker, tokenizer, phrases: dict[str, list[str]]) -> list:
    cue = UtteranceEnd(worker, tokenizer, 0.0)
    rows = []
    try:
        for label, texts in phrases.items():
            for text in texts:
                t0 = time.perf_counter()
                score = await cue.score(text)
                rows.append({"text": text, "words": normalise(text), "label": label,
                             "logprob": score, "ms": (time.perf_counter() - t0) * 1000,
                             "held_by_words": ending(text) == UNFINISHED})
    finally:
        cue.close()
    return rows


SWEEP = (-3.0, -4.0, -5.0, -6.0, -7.0, -8.0, -9.0, -10.0, -12.0)


def held(rows: list[dict], threshold: float) -> list[dict]:
    """Finished messages that a threshold holds (the words alone leaving them finished)."""
    return [r for r in rows if r["label"] == "finished" and not r["held_by_words"]
            and r["logprob"] < threshold]


def let_end(rows: list[dict], threshold: float) -> list[dict]:
    """Fragments that a threshold lets end (where the words alone would too)."""
    return [r for r in rows if r["label"] == "unfinished" and not r["held_by_words"]
            and r["logprob"] >= threshold]


def summarise(rows: list[dict], threshold: float | None) -> dict:
    by = {label: [r["logprob"] for r in rows if r["label"] == label] for label in LABELS}
    sweep = sorted({*SWEEP, *([threshold] if threshold is not None else [])}, reverse=True)
    return {
        **{f"{label}_range": [min(by[label]), max(by[label])] for label in LABELS},
        **{f"{label}_count": sum(not r["held_by_words"] for r in rows if r["label"] == label)
           for label in LABELS},
        "threshold": threshold,
        "sweep": [{"threshold": t, "finished_held": len(held(rows, t)),
                   "fragments_let_end": len(let_end(rows, t))} for t in sweep],
        "ms_p50": percentile([r["ms"] for r in rows], 50),
    }


def render(rows: list[dict], summary: dict) -> str:
    threshold = summary["threshold"]
    wrong = [] if threshold is None else held(rows, threshold) + let_end(rows, threshold)
    lines = ["| label | words (as scored) | log p(ends here) | verdict |",
             "| --- | --- | --: | --- |"]
    for r in sorted(rows, key=lambda r: -r["logprob"]):
        verdict = "-" if threshold is None else "holds" if r["logprob"] < threshold else "ends"
        if r["held_by_words"]:
            verdict = "held by the words"
        lines.append(f"| {r['label']} | {r['words']} | {r['logprob']:.1f} | {verdict}"
                     f"{' (wrong)' if r in wrong else ''} |")
    fin, unf = summary["finished_range"], summary["unfinished_range"]
    lines += ["", f"Finished {fin[0]:.1f} to {fin[1]:.1f}, unfinished {unf[0]:.1f} to "
              f"{unf[1]:.1f}; a score took {fmt(summary['ms_p50'], 0)} ms p50 (each phrase from "
              "the template's cached prefix).", "",
              "Counted below: the phrases whose words alone do not hold the turn.", "",
              f"| threshold | finished held (of {summary['finished_count']}) | fragments let "
              f"end (of {summary['unfinished_count']}) |", "| --: | --: | --: |"]
    for row in summary["sweep"]:
        mark = " (configured)" if row["threshold"] == threshold else ""
        lines.append(f"| {row['threshold']}{mark} | {row['finished_held']} | "
                     f"{row['fragments_let_end']} |")
    return "\n".join(lines)
