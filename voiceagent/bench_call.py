"""`voiceagent bench call`: the same scripted calls with speculation off and on, side by side.

Seed 001's bounded comparison: freeze the workload, measure with the feature on and off. Each
scripted call runs once per mode, modes interleaved call by call, so machine noise falls on both.
Reported per mode: turn end -> first audio (clock 3) p50/p95, request -> first token (clock 1),
ITL (clock 2) p50, barge-in -> bot silent, and the median breakdown.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import yaml

from audio.loaders import load_piper
from audio.synth import silence, synthesize
from voiceagent.bench_report import save_results, utc_stamp
from voiceagent.call import RATE, simulate_call
from voiceagent.config import REPO_ROOT, Config
from voiceagent.dashboard.stats import BREAKDOWN, summarise
from voiceagent.models import resolve
from voiceagent.pipeline.builder import load_shared

DEFAULT_SCRIPT = REPO_ROOT / "configs" / "prompts" / "call_bench_v1.yaml"


def caller_audio(voice, turns: list[dict]) -> np.ndarray:
    parts = [silence(0.5)]
    for turn in turns:
        parts += [synthesize(voice, turn["say"], RATE), silence(float(turn["then"]))]
    return np.concatenate(parts)


def _f(x) -> str:
    return "–" if x is None else f"{x:.0f}"


def render(summary: dict[str, dict]) -> str:
    lines = [
        "| mode | turns | interrupted | turn end→first audio p50 / p95 ms | request→first token "
        "p50 ms | ITL p50 / p95 ms | barge-in→silent p50 / max ms | acc/step |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for mode, s in summary.items():
        c3, c1, itl, bi = (s["turn_end_to_first_audio_ms"], s["request_to_first_token_ms"],
                           s["itl_ms"], s["barge_in_to_silence_ms"])
        acc = s["mean_accepted_per_step"]
        lines.append(
            f"| {mode} | {s['turns']} | {s['interrupted']} | {_f(c3['p50'])} / {_f(c3['p95'])} | "
            f"{_f(c1['p50'])} | {_f(itl['p50'])} / {_f(itl['p95'])} | {_f(bi['p50'])} / "
            f"{_f(bi['max'])} | {'–' if acc is None else f'{acc:.2f}'} |"
        )
    lines += ["", "Median breakdown (ms):", "",
              "| mode | " + " | ".join(BREAKDOWN) + " |", "|---|" + "--:|" * len(BREAKDOWN)]
    for mode, s in summary.items():
        row = " | ".join(_f(s["breakdown_p50_ms"][k]) for k in BREAKDOWN)
        lines.append(f"| {mode} | {row} |")
    return "\n".join(lines)


async def _run(cfg: Config, script: dict, modes: list[str], repeats: int) -> dict[str, list]:
    say = lambda msg: print(msg, file=sys.stderr)  # noqa: E731 - progress on stderr
    shared = load_shared(cfg, say, also=modes)
    voice = load_piper(resolve(cfg.tts.voice, "tts").location)
    turns: dict[str, list] = {m: [] for m in modes}
    try:
        for r in range(repeats):
            for i, call in enumerate(script["calls"]):
                audio = caller_audio(voice, call["turns"])
                call_cfg = cfg.model_copy(deep=True)
                if "system_prompt" in call:
                    call_cfg.agent.system_prompt = call["system_prompt"]
                    call_cfg.engine.sampling.max_new_tokens = 160
                order = modes if (r + i) % 2 == 0 else modes[::-1]
                for mode in order:
                    result = await simulate_call(call_cfg, shared, audio, method=mode)
                    say(f"[{call['name']}] {mode}: {len(result.turns)} turn(s)")
                    turns[mode] += [dict(t.to_dict(), script_call=call["name"])
                                    for t in result.turns]
    finally:
        shared.close()
    return turns


def run_call_bench(cfg: Config, args) -> int:
    script_path = Path(args.script or DEFAULT_SCRIPT)
    script = yaml.safe_load(script_path.read_text())
    modes = [m.strip() for m in (args.modes or "off,ngram").split(",") if m.strip()]
    turns = asyncio.run(_run(cfg, script, modes, args.repeats))
    summary = {m: summarise(t) for m, t in turns.items()}
    stamp = utc_stamp()
    header = (f"# Call benchmark\n\n- {stamp}, script {script_path.name} v{script.get('version')},"
              f" modes {', '.join(modes)}, {args.repeats} repeat(s), target "
              f"`{cfg.engine.target}`\n\n")
    markdown = header + render(summary) + "\n"
    save_results(args.out, "call", stamp, markdown,
                 {"summary": summary, "turns": turns, "config": cfg.model_dump(mode="json")})
    return 0
