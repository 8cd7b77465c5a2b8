"""`voiceagent bench call`: the same scripted calls under several variants, side by side.

A bounded comparison: freeze the workload, measure with the feature on and off. A variant
is a speculation method with optional features, `METHOD[+prepare][+smart_turn]`: early response
preparation and the Smart Turn stop strategy on (a feature left out of the name is off), and
optional config overrides after colons (`off:vad.stop_secs=0.3`). `--backend NAME=URL` adds a
remote OpenAI-compatible server (vLLM, SGLang, another `serve`) as the LLM of the variants whose
METHOD is NAME, so in-process and remote engines, speculation off and on, run in one table. Each
scripted call runs once per variant, variants interleaved call by call, so machine noise falls on
all. Reported per variant: turn end -> first audio (clock 3) p50/p95, request -> first token
(clock 1), ITL (clock 2) p50, barge-in -> bot silent, the median breakdown, and preparation:
committed and discarded replies and the wasted work as a share of the work that answered; and
the turns that called a tool: turn end -> first audio of the spoken result, and how many were
heard within 1 s; and the per-stage floor (floor.py): each stage's p50 beside what it costs alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from audio.synth import silence, synthesize
from voiceagent.bench.false_starts import false_starts, sentences, voiced_runs
from voiceagent.bench.floor import measure_floor, render_floor
from voiceagent.bench.results import save_results, utc_stamp
from voiceagent.config import PROMPTS_DIR, Config, LLMConfig, apply_override
from voiceagent.dashboard.stats import BREAKDOWN, summarise
from voiceagent.dashboard.store import open_store
from voiceagent.figures import fmt, fmt_share, percentile
from voiceagent.logs import progress_bar, write
from voiceagent.pipeline.builder import SharedModels, load_shared
from voiceagent.pipeline.remote_llm import RemoteChat, RemoteLLMError, connect
from voiceagent.pipeline.speech_models import SpeechModels
from voiceagent.sim.call import RATE, simulate_call
from voiceagent.urls import redact

DEFAULT_SCRIPT = PROMPTS_DIR / "call_bench_v3.yaml"
TOOL_TURN_GOAL_MS = 1000.0  # a tool's spoken result this soon after the turn end
DEFAULT_VARIANTS = "off,ngram,off+prepare,ngram+prepare"
FEATURES = ("prepare", "smart_turn")


@dataclass(frozen=True)
class Variant:
    """`METHOD[+prepare][+smart_turn][:key=value...]`: a speculation method, the turn features
    on (the others off), and any config overrides, e.g. `off:vad.stop_secs=0.3` or
    `ngram+prepare:tts.cpu_threads=1`."""

    name: str
    method: str
    prepare: bool
    smart_turn: bool
    overrides: tuple[str, ...] = ()

    @classmethod
    def parse(cls, name: str) -> Variant:
        head, *overrides = name.split(":")
        method, *features = head.split("+")
        unknown = set(features) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown feature {'+'.join(sorted(unknown))!r} in variant {name!r}; "
                             f"features: {', '.join(FEATURES)}")
        return cls(name, method, "prepare" in features, "smart_turn" in features,
                   tuple(overrides))

    def configure(self, cfg: Config) -> Config:
        data = cfg.model_dump(mode="json")
        for item in self.overrides:
            apply_override(data, item)
        data["turn"].update(prepare=self.prepare,
                            stop="smart_turn" if self.smart_turn else "vad")
        return Config.model_validate(data)


def caller_audio(voice, turns: list[dict]) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """The caller's side of a scripted call, and its sentences' (start, end) seconds."""
    parts, spoken, at = [silence(0.5)], [], 0.5
    for turn in turns:
        said, pause = synthesize(voice, turn["say"], RATE), float(turn["then"])
        runs = voiced_runs(said, RATE)
        spoken.append((at + runs[0][0], at + runs[-1][1], pause))
        parts += [said, silence(pause)]
        at += (len(said) + len(parts[-1])) / RATE
    return np.concatenate(parts), sentences(spoken)


def tool_turns(turns: list[dict]) -> dict:
    """The turns that called a tool: clock 3 (turn end -> the spoken result's first audio),
    the tools' own time, and how many results were heard within TOOL_TURN_GOAL_MS."""
    called = [t for t in turns if t.get("tool_calls") and not t.get("interrupted")]
    c3 = [t["clocks"]["turn_end_to_first_audio_ms"] for t in called
          if t["clocks"]["turn_end_to_first_audio_ms"] is not None]
    tools = [c["duration_ms"] for t in called for c in t["tool_calls"]
             if c.get("duration_ms") is not None]
    return {"turns": len(called), "calls": sum(len(t["tool_calls"]) for t in called),
            "failed": sum(not c["ok"] for t in called for c in t["tool_calls"]),
            "c3_p50": percentile(c3, 50), "c3_p95": percentile(c3, 95),
            "tool_ms_p50": percentile(tools, 50),
            "within_goal": sum(v <= TOOL_TURN_GOAL_MS for v in c3)}


def render_tool_turns(by_mode: dict[str, dict]) -> str:
    lines = ["Turns that called a tool (clock 3 ends at the spoken result's first audio):", "",
             "| mode | tool turns | calls (failed) | turn end→result audio p50 / p95 ms | "
             "tool ms p50 | within 1 s |", "|---|--:|--:|--:|--:|--:|"]
    for mode, s in by_mode.items():
        lines.append(f"| {mode} | {s['turns']} | {s['calls']} ({s['failed']}) | "
                     f"{fmt(s['c3_p50'], 0)} / {fmt(s['c3_p95'], 0)} | "
                     f"{fmt(s['tool_ms_p50'], 0)} | {s['within_goal']} of {s['turns']} |")
    return "\n".join(lines)


def render_answers(turns: dict[str, list], said_over: dict[str, dict[str, list[float]]],
                   script: dict) -> str:
    """Per scripted call: the caller's turns each variant answered (a turn that went on with
    the one before is the same sentence, `summarise`'s `continued`), beside the utterances; and
    the bot's false starts inside the caller's sentences (false_starts.py)."""
    lines = ["| call | utterances | " + " | ".join(turns) + " |",
             "|---|--:|" + "--:|" * len(turns)]
    for call in script["calls"]:
        cells = []
        for mode, records in turns.items():
            mine = [t for t in records if t["script_call"] == call["name"]]
            s = summarise(mine)
            runs = max(s["calls"], 1)
            heard = said_over[mode].get(call["name"], [])
            cells.append(f"{(s['turns'] - s['continued']) / runs:g} ({s['turns'] / runs:g})"
                         + (f"; {s['early_ends']} early end(s)" if s["early_ends"] else "")
                         + (f"; {len(heard)} false start(s), {sum(heard):g} ms heard"
                            if heard else ""))
        lines.append(f"| {call['name']} | {len(call['turns'])} | " + " | ".join(cells) + " |")
    return ("Answered turns per call (all turns, with those that went on with the one before), "
            "averaged over the repeats; the pauses a turn ended at and the caller went on from "
            "before hearing the reply (early ends: one turn, its reply withdrawn unheard); and "
            "the bot's speech that began inside the caller's sentence (false starts), summed "
            "over the repeats:\n\n" + "\n".join(lines))


def render(summary: dict[str, dict]) -> str:
    lines = [
        "| mode | turns | interrupted | continued | turn end→first audio p50 / p95 ms | "
        "request→first token p50 ms | ITL p50 / p95 ms | barge-in→silent p50 / max ms | "
        "acc/step |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for mode, s in summary.items():
        c3, c1, itl, bi = (s["turn_end_to_first_audio_ms"], s["request_to_first_token_ms"],
                           s["itl_ms"], s["barge_in_to_silence_ms"])
        acc = s["accepted_per_step"]
        lines.append(
            f"| {mode} | {s['turns']} | {s['interrupted']} | {s['continued']} | "
            f"{fmt(c3['p50'], 0)} / {fmt(c3['p95'], 0)} | {fmt(c1['p50'], 0)} | "
            f"{fmt(itl['p50'], 0)} / {fmt(itl['p95'], 0)} | "
            f"{fmt(bi['p50'], 0)} / {fmt(bi['max'], 0)} | {fmt(acc, 2)} |"
        )
    lines += ["", "Early preparation:", "",
              "| mode | prepared turns | committed | false commits | discarded | lead p50 ms | "
              "wasted tokens | wasted audio |", "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for mode, s in summary.items():
        p = s["preparation"]
        lines.append(
            f"| {mode} | {p['prepared_turns']} | {p['committed']} | {p['false_commits']} | "
            f"{p['discarded']} | "
            f"{fmt(p['lead_ms_p50'], 0)} | {fmt_share(p['wasted_tokens_share'])} | "
            f"{fmt_share(p['wasted_audio_share'])} |")
    lines += ["", "Median breakdown (ms):", "",
              "| mode | " + " | ".join(BREAKDOWN) + " |", "|---|" + "--:|" * len(BREAKDOWN)]
    for mode, s in summary.items():
        row = " | ".join(fmt(s["breakdown_p50_ms"][k], 0) for k in BREAKDOWN)
        lines.append(f"| {mode} | {row} |")
    return "\n".join(lines)


def parse_backends(specs: list[str] | None) -> dict[str, str]:
    """`NAME=URL` items of `--backend` -> {name: base URL}."""
    backends = {}
    for spec in specs or []:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--backend {spec!r}: expected NAME=URL, e.g. "
                             "vllm=http://127.0.0.1:8000/v1")
        backends[name] = url
    return backends


def connect_backends(cfg: Config, backends: dict[str, str]) -> dict[str, RemoteChat]:
    """Each remote server checked (it answers, it serves the model), named for the table."""
    return {name: connect(LLMConfig(backend="openai", base_url=url, name=name,
                                    model=cfg.llm.model, api_key_env=cfg.llm.api_key_env,
                                    timeout_s=cfg.llm.timeout_s), cfg.engine.sampling)
            for name, url in backends.items()}


def _load(cfg: Config, variants: list[Variant], remotes: dict[str, RemoteChat],
          say) -> SharedModels:
    """The in-process engine only when a variant runs on it (with the drafts they use); Smart
    Turn when a variant ends turns with it."""
    base = cfg.model_copy(deep=True)
    if any(v.smart_turn for v in variants):
        base.turn.stop = "smart_turn"
    local = [v.method for v in variants if v.method not in remotes]
    if local:
        base.llm = LLMConfig()
        return load_shared(base, say, also=local)
    base.llm = next(iter(remotes.values())).cfg
    return load_shared(base, say)


def speech_per_variant(cfg: Config, variants: list[Variant], shared: SpeechModels,
                       say, engine_threads: int | None = None) -> dict[str, SpeechModels]:
    """The `shared` speech models, and for a variant that changes them (`:tts.cpu_threads=1`)
    its own, loaded once per setting (beside the engine's `engine_threads`)."""
    loaded, out = [shared], {}
    for v in variants:
        variant_cfg = v.configure(cfg)
        models = next((m for m in loaded if m.serves(variant_cfg) is None), None)
        if models is None:
            models = SpeechModels.load(variant_cfg, say, engine_threads)
            loaded.append(models)
        out[v.name] = models
    return out


def counted_during(before: dict | None, after: dict | None) -> str:
    """A remote server's speculation over the run, from its counters before and after (vLLM's
    are server-wide: other traffic to it during the run counts too)."""
    if before is None or after is None:
        return "no speculation counters"
    drafts, drafted, accepted = (after.get(k, 0) - before.get(k, 0) for k in
                                 ("drafts", "draft_tokens", "accepted_tokens"))
    if drafted <= 0 or drafts <= 0:  # none, or the server restarted during the run
        return "no drafts counted during the run"
    return (f"{100 * accepted / drafted:.0f}% of {drafted:.0f} drafted tokens accepted, "
            f"{accepted / drafts:.2f} per draft (its counters, during this run)")


async def _run(cfg: Config, script: dict, variants: list[Variant], repeats: int,
               remotes: dict[str, RemoteChat]) -> tuple[dict[str, list], dict[str, str]]:
    say = write  # progress on stderr, above the bar on a terminal
    shared = _load(cfg, variants, remotes, say)
    voice = shared.speech.voice  # the caller speaks with the bot's voice
    speech = speech_per_variant(cfg, variants, shared.speech, say,
                                shared.llm.threads if shared.llm else None)
    turns: dict[str, list] = {v.name: [] for v in variants}
    said_over: dict[str, dict[str, list[float]]] = {v.name: {} for v in variants}
    before = {name: await chat.speculation() for name, chat in remotes.items()}
    bar = progress_bar(repeats * len(script["calls"]) * len(variants), "bench call", "call")
    store = open_store(cfg)  # the bench's calls show on the dashboard like any other
    try:
        for r in range(repeats):
            for i, call in enumerate(script["calls"]):
                audio, said = caller_audio(voice, call["turns"])
                call_cfg = cfg.model_copy(deep=True)
                if "system_prompt" in call:
                    call_cfg.agent.system_prompt = call["system_prompt"]
                    call_cfg.engine.sampling.max_new_tokens = 160
                order = variants if (r + i) % 2 == 0 else variants[::-1]
                for v in order:
                    models = dataclasses.replace(shared, speech=speech[v.name])
                    if v.method in remotes:
                        models = dataclasses.replace(models, chat=remotes[v.method])
                    result = await simulate_call(v.configure(call_cfg), models, audio,
                                                 method=v.method, store=store)
                    went_on = sum(t.continues for t in result.turns)
                    early = sum(t.early_ends for t in result.turns)
                    heard = false_starts(result.bot, RATE, said)
                    said_over[v.name].setdefault(call["name"], []).extend(heard)
                    say(f"[{call['name']}] {v.name}: {len(result.turns)} turn(s)"
                        + (f", {went_on} going on with the one before" if went_on else "")
                        + (f", {early} early end(s) withdrawn unheard" if early else "")
                        + (f", the bot began inside the caller's sentence {len(heard)} time(s)"
                           f" ({sum(heard)} ms heard)" if heard else ""))
                    bar.update()
                    turns[v.name] += [dict(t.to_dict(), script_call=call["name"])
                                      for t in result.turns]
        say("measuring each stage alone (the per-stage floor) ...")
        utterances = list(dict.fromkeys(t["say"] for c in script["calls"] for t in c["turns"]))
        floor = await measure_floor(cfg, shared, utterances)
    finally:
        bar.close()
        store.close()
        shared.close()
        for models in {id(m): m for m in speech.values()}.values():
            if models is not shared.speech:  # a variant's own: its worker threads end too
                models.close()
    spec = {name: counted_during(before[name], await chat.speculation())
            for name, chat in remotes.items()}
    return turns, said_over, spec, floor


def run_call_bench(cfg: Config, args) -> int:
    script_path = Path(args.script or DEFAULT_SCRIPT)
    script = yaml.safe_load(script_path.read_text())
    backends = parse_backends(args.backend)
    default = ",".join(["off", "ngram", *backends]) if backends else DEFAULT_VARIANTS
    modes = [m.strip() for m in (args.methods or default).split(",") if m.strip()]
    variants = [Variant.parse(m) for m in modes]
    for v in variants:
        v.configure(cfg)  # a bad override fails now, not after the models have loaded
    try:
        remotes = connect_backends(cfg, backends)
    except RemoteLLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    turns, said_over, remote_spec, floor = asyncio.run(
        _run(cfg, script, variants, args.repeats, remotes))
    summary = {m: summarise(t) for m, t in turns.items()}
    tools = {m: tool_turns(t) for m, t in turns.items()}
    stamp = utc_stamp()
    header = (f"# Call benchmark\n\n- {stamp}, script {script_path.name} v{script.get('version')},"
              f" modes {', '.join(modes)}, {args.repeats} repeat(s), target "
              f"`{cfg.engine.target}`\n")
    for name, chat in remotes.items():
        header += f"- {name}: `{chat.model}` on {redact(chat.cfg.base_url)}; {remote_spec[name]}\n"
    header += "\n"
    markdown = (header + render(summary) + "\n\n" + render_floor(floor, summary) + "\n\n"
                + render_tool_turns(tools) + "\n\n" + render_answers(turns, said_over, script)
                + "\n")
    save_results(args.out, "call", stamp, markdown,
                 {"summary": summary, "tool_turns": tools, "floor": floor, "turns": turns,
                  "false_starts_ms": said_over,
                  "config": cfg.model_dump(mode="json")})
    return 0
