"""`voiceagent bench engine --batch 1,2,4`: several sessions decoding at once on one engine.

For each mode and each number of sessions, the same requests (greedy, the prompt set's
conversation prompts, one per session) run twice side by side, stepped as the serving worker
steps them: one step per request in turn (`engine.step`, each its own forward) and one shared
step per round (`engine.step_many`: every request's rows in one forward where the runner shares
forwards). Each request is prefilled first; the figures are its decode phase. Every request
decodes all its tokens past any EOS (`ignore_eos`, as vLLM's throughput benchmark does), so that
without speculation N sessions decode together from the first round to the last (a speculating
session commits a varying count a round, so it may end a few rounds apart); `--stop-at-eos` ends
each at its EOS instead (a short reply then leaves the others fewer rounds all together). Past
its EOS a session tends to repeat itself, which n-grams draft well: a speculating mode's rates
read higher than on replies that end.

- aggregate tok/s (`aggregate_tok_s`): every session's tokens after its first, over the wall
  time from the decode phase's start to the last session's end (sessions that end apart leave
  the last rounds fewer sessions);
- all live, tok/s: the same over only the rounds in which every session was still decoding,
  N sessions at once;
- per-session tok/s: each request's own decode rate (`RequestStats.tokens_per_s`), the median;
- identical: every session's tokens in the shared run equal its tokens stepped one by one
  (each its own forward, as alone);
- shared ÷ 1 session: against the same mode's one session of this run;
- all live ÷ 1 session: the all-live rate's median over the one session's, and with repeats, in
  brackets, the lowest and highest of each repeat's own ratio (`paired_ratios`: the two sides
  measured a minute apart at most, where the medians may come from different minutes);
- attending alone: the shared forward with each session attending over its cache in a product of
  its own (the lean runner before its cache pool), where the runner attends in one product.

With `--repeats N` each cell is the median of N runs of each way, taken in turn, and the session
counts in turn within each repeat (1, 2, 4, 1, 2, 4, ...), so that drift on a shared machine
falls on both sides of a ratio.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from llm_engine import methods
from llm_engine.config import SamplingConfig
from llm_engine.engine import SpeculativeEngine
from llm_engine.prompts import encode_chat
from voiceagent import logs
from voiceagent.bench.engine import machine_info
from voiceagent.config import Config
from voiceagent.figures import fmt
from voiceagent.prompt_sets import load_prompt_set, messages


def aggregate_tok_s(decoded_tokens: int, seconds: float) -> float:
    """Every session's decoded tokens (after its first) per second of the shared wall time."""
    return decoded_tokens / seconds if seconds > 0 else 0.0


def batch_sampling(max_new_tokens: int, stop_at_eos: bool = False) -> SamplingConfig:
    """Greedy; past any EOS unless `stop_at_eos` (the module doc)."""
    return SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens,
                          ignore_eos=not stop_at_eos)


def one_product(engine: SpeculativeEngine) -> bool:
    """Whether the engine's shared forwards attend over the pooled caches in one product."""
    return bool(getattr(getattr(engine.runner, "lean", None), "batch_attention", False))


def decode_together(engine: SpeculativeEngine, prompts: list[list[int]],
                    sampling: SamplingConfig, method: str, shared: bool,
                    attend_alone: bool = False) -> dict:
    """The prompts as live requests to their end; `shared`: stepped with `step_many`, else one
    `step` each in turn (the worker before shared forwards); `attend_alone`: a shared forward's
    requests attend each in a product of its own."""
    if attend_alone:
        lean, before = engine.runner.lean, engine.runner.lean.batch_attention
        lean.batch_attention = False
        try:
            return decode_together(engine, prompts, sampling, method, shared)
        finally:
            lean.batch_attention = before
    states = [engine.start(p, sampling, method=method) for p in prompts]
    while not all(s.prefilled or s.finished for s in states):
        for state in states:
            if not (state.prefilled or state.finished):
                engine.step(state)
    first_tokens = [len(s.output_ids) for s in states]
    t0 = time.perf_counter()
    all_live_s, all_live_tokens = 0.0, 0
    while live := [s for s in states if not s.finished]:
        before, t_round = sum(len(s.output_ids) for s in live), time.perf_counter()
        results = engine.step_many(live) if shared else [engine.step(s) for s in live]
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            raise failed[0]
        if len(live) == len(states):
            all_live_s += time.perf_counter() - t_round
            all_live_tokens += sum(len(s.output_ids) for s in live) - before
    seconds = time.perf_counter() - t0
    for state in states:
        engine.release(state)
    decoded = sum(len(s.output_ids) - n for s, n in zip(states, first_tokens, strict=True))
    return {
        "aggregate_tok_s": aggregate_tok_s(decoded, seconds),
        # None: a session ended at its prefill, so no round had them all
        "all_live_tok_s": aggregate_tok_s(all_live_tokens, all_live_s) if all_live_s else None,
        "all_live_tokens": all_live_tokens,
        "session_tok_s": [s.stats.tokens_per_s for s in states],
        "outputs": [s.output_ids for s in states],
    }


def run_batch(engine: SpeculativeEngine, prompts: list[list[int]], sizes: list[int],
              modes: list[str], max_new_tokens: int, say=logs.write,
              repeats: int = 1, stop_at_eos: bool = False) -> list[dict]:
    """A row per mode and number of sessions; with `repeats`, every session count's ways are run
    that many times, the counts in turn within each repeat (so that a ratio's two sides are
    measured minutes apart at most, not a whole sweep: a shared machine drifts), and each rate
    is the median of its runs."""
    sampling = batch_sampling(max_new_tokens, stop_at_eos)
    pooled = one_product(engine)
    rows = []
    for mode in modes:
        decode_together(engine, prompts[:1], sampling, mode, shared=True)  # warm this mode
        runs: dict[int, list] = {n: [] for n in sizes}
        for repeat in range(max(1, repeats)):
            for sessions in sizes:
                chosen = [prompts[j % len(prompts)] for j in range(sessions)]
                say(f"batch: {mode}, {sessions} session(s), run {repeat + 1} of {max(1, repeats)}")
                runs[sessions].append((
                    decode_together(engine, chosen, sampling, mode, shared=False),
                    decode_together(engine, chosen, sampling, mode, shared=True),
                    decode_together(engine, chosen, sampling, mode, shared=True,
                                    attend_alone=True) if pooled and sessions > 1 else None))
        rows += [_row(mode, sessions, runs[sessions]) for sessions in sizes]
    for row in rows:  # against one session of the same mode, measured in this run
        one = next((r for r in rows if r["mode"] == row["mode"] and r["sessions"] == 1), None)
        row["shared_vs_one_session"] = _ratio(row["shared_tok_s"], one and one["shared_tok_s"])
        row["all_live_vs_one_session"] = _ratio(row["all_live_tok_s"],
                                                one and one["all_live_tok_s"])
        row["all_live_vs_one_session_runs"] = paired_ratios(
            row["all_live_runs_tok_s"], one["all_live_runs_tok_s"]) if one else []
    return rows


def _row(mode: str, sessions: int, runs: list[tuple]) -> dict:
    """One mode's and session count's medians over its runs (one by one, shared, alone)."""
    per_session = [t for _, together, _ in runs for t in together["session_tok_s"]
                   if t is not None]
    alone = [c for _, _, c in runs if c is not None]
    return {
        "mode": mode,
        "sessions": sessions,
        "repeats": len(runs),
        "one_by_one_tok_s": statistics.median(a["aggregate_tok_s"] for a, _, _ in runs),
        "shared_tok_s": statistics.median(b["aggregate_tok_s"] for _, b, _ in runs),
        "all_live_tok_s": _median(b["all_live_tok_s"] for _, b, _ in runs),
        "all_live_runs_tok_s": [b["all_live_tok_s"] for _, b, _ in runs],  # by repeat
        "attend_alone_tok_s": statistics.median(c["aggregate_tok_s"] for c in alone)
        if alone else None,
        "session_tok_s_p50": statistics.median(per_session) if per_session else None,
        "identical": all(b["outputs"] == a["outputs"] and (c is None or
                                                           c["outputs"] == a["outputs"])
                         for a, b, c in runs),
    }


def paired_ratios(runs: list[float | None], ones: list[float | None]) -> list[float]:
    """Each repeat's rate over the one-session rate of the same repeat (measured next to it, so
    that a drift of the machine between repeats cancels), where both are known."""
    ratios = (_ratio(a, b) for a, b in zip(runs, ones, strict=True))
    return [r for r in ratios if r is not None]


def _median(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _spread(row: dict) -> str:
    """ " (lowest–highest)" of a row's per-repeat ratios, where it has two or more (not the one
    session's own row: 1.00 each)."""
    runs = row.get("all_live_vs_one_session_runs") or []
    return f" ({min(runs):.2f}–{max(runs):.2f})" if len(runs) > 1 and row["sessions"] > 1 else ""


def render(rows: list[dict], header: list[str]) -> str:
    lines = [*header, "",
             "| mode | sessions | one by one, tok/s | shared forward, attending alone, tok/s "
             "| shared forward, tok/s | shared ÷ one by one "
             "| shared ÷ 1 session | all live, tok/s | all live ÷ 1 session "
             "| per-session tok/s p50 | identical |",
             "| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --- |"]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['sessions']} | {fmt(r['one_by_one_tok_s'], 1)} | "
            f"{fmt(r.get('attend_alone_tok_s'), 1)} | {fmt(r['shared_tok_s'], 1)} | "
            f"{fmt(_ratio(r['shared_tok_s'], r['one_by_one_tok_s']), 2, 'x')} | "
            f"{fmt(r['shared_vs_one_session'], 2, 'x')} | {fmt(r['all_live_tok_s'], 1)} | "
            f"{fmt(r['all_live_vs_one_session'], 2, 'x')}{_spread(r)} | "
            f"{fmt(r['session_tok_s_p50'], 1)} | "
            f"{'yes' if r['identical'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def run_batch_bench(cfg: Config, args) -> int:
    from voiceagent.llm_setup import build_runtime

    sizes = sorted({int(n) for n in args.batch.split(",")})
    if not sizes or sizes[0] < 1:
        raise ValueError("--batch takes session counts of at least 1, e.g. 1,2,4")
    modes = [m.strip() for m in (args.methods or f"off,{cfg.engine.speculation.method}").split(",")]
    modes = list(dict.fromkeys(m for m in modes if m))
    for mode in modes:
        methods.check(mode, "method")
    started, load_at_start = datetime.now(UTC), os.getloadavg()[0]
    runtime = build_runtime(cfg.engine, cfg.paths.cache_dir, logs.write, also=modes)
    engine, tokenizer = runtime.engine, runtime.target.tokenizer
    prompt_set = load_prompt_set(args.prompts)
    texts = [t for name, seg in prompt_set.segments.items()
             if name not in prompt_set.tools and name not in prompt_set.on_request for t in seg]
    prompts = [encode_chat(tokenizer, messages(prompt_set.system, t)) for t in texts]
    rows = run_batch(engine, prompts, sizes, modes, args.max_new_tokens or 64,
                     repeats=args.repeats, stop_at_eos=args.stop_at_eos)
    machine = {**machine_info(engine.device), "load_avg_1m_at_start": load_at_start}
    attends = "over pooled caches in one product" if one_product(engine) else "alone"
    header = [
        f"# Engine, sessions at once ({started:%Y-%m-%d %H:%M} UTC)", "",
        f"- CPU: {machine['cpu']}, {machine['cpu_count']} cores, torch threads "
        f"{machine['torch_threads']}; load {load_at_start:.1f} at start, "
        f"{machine['load_avg_1m']:.1f} at end",
        f"- target {cfg.engine.target}, format {engine.runner.format} ({engine.runner.name} "
        f"runner, shares forwards of up to {engine.runner.shared_rows} rows, "
        f"each session attending {attends}), greedy, "
        f"{args.max_new_tokens or 64} new tokens a session "
        f"({'each ending at its EOS' if args.stop_at_eos else 'past any EOS'}); "
        f"each rate the median of "
        f"{max(1, args.repeats)} run(s) of each way, alternating, the session counts in turn",
    ]
    markdown = render(rows, header)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    (out / f"batch-{stamp}.json").write_text(json.dumps(
        {"started_utc": started.isoformat(), "machine": machine, "rows": rows}, indent=1))
    (out / f"batch-{stamp}.md").write_text(markdown)
    print(markdown)
    logs.write(f"wrote {out / f'batch-{stamp}.md'}")
    return 0 if all(r["identical"] for r in rows) else 1
