"""`voiceagent bench engine`: our engine's modes against Hugging Face `generate()`, side by side.

The synchronous engine is driven directly (start / step / release on this thread), which is its
cost without the asyncio bridge. The baselines run through `generate()` on the same loaded target:
plain, `prompt_lookup_num_tokens` (Saxena 2023) and `assistant_model` (Leviathan et al. 2023) when a
draft is loaded: what a user would pick instead. The machine is noisy, so every mode runs on each
prompt before the next prompt starts, in an order rotated per prompt, and ratios are taken per
prompt pair (`voiceagent.bench.results`). Seeded sampling uses the same seed in every mode.

A tool-call segment (one whose prompts carry tools) is decoded under the tools grammar with
tool_choice "required" in every engine mode, `off` included, so `grammar` and `grammar+<one>`
are measured against constrained plain decoding; each call is checked against its tool's schema.
The HF baselines and the anchor cannot decode under a grammar and skip those prompts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import jsonschema
import torch
import transformers
from transformers.generation.streamers import BaseStreamer

from llm_engine import formats, methods
from llm_engine.config import GrammarSpec, SamplingConfig
from llm_engine.cost_model import cpu_model
from llm_engine.engine import SpeculativeEngine
from llm_engine.grammar import parse_tool_call, tool_functions
from llm_engine.prompts import encode_chat
from llm_engine.runner import EagerRunner
from llm_engine.sampling import is_greedy
from voiceagent import logs
from voiceagent.bench.anchor import AnchorError, anchor_runner, connect
from voiceagent.bench.formats import format_section, render_formats
from voiceagent.bench.results import (
    ANCHOR,
    FORMAT_MARK,
    REFERENCE,
    RunRecord,
    is_baseline,
    render_markdown,
    summarise,
)
from voiceagent.config import Config
from voiceagent.logs import progress_bar
from voiceagent.prompt_sets import PromptSet, heldout_conversations, load_prompt_set, messages


@dataclass
class BenchSettings:
    modes: list[str]  # engine modes, `off` first; HF modes are added when `hf` is on
    hf: bool = True
    temperatures: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.8])
    max_new_tokens: int = 64
    repeats: int = 1
    segments: list[str] | None = None  # None: every segment of the prompt set
    prompts_per_segment: int | None = None  # None: all
    seed: int = 0  # the same for every mode, so sampled runs are reproducible
    top_k: int = 0
    top_p: float = 1.0
    hf_lookup_tokens: int = 10  # HF's documented example value for prompt_lookup_num_tokens
    warmup_tokens: int = 8
    # Weight formats to run every mode in; the engine's chosen one runs as plain mode names,
    # the others as mode@format. Empty: the chosen format only.
    formats: list[str] = dataclasses.field(default_factory=list)
    quality: bool = False  # teacher-forced agreement of each format with fp32
    anchor_url: str | None = None  # an OpenAI-compatible server timed as mode `anchor`
    anchor_model: str | None = None  # None: the first model it serves
    # A tool call's budget at least: a complete call ends the request (EOS), so this only bounds
    # one that runs long, and a call cut off by the budget counts as invalid.
    tool_call_tokens: int = 128

    def sampling(self, temperature: float, max_new_tokens: int | None = None,
                 grammar: GrammarSpec | None = None) -> SamplingConfig:
        if max_new_tokens is None:
            max_new_tokens = (self.max_new_tokens if grammar is None
                              else max(self.max_new_tokens, self.tool_call_tokens))
        return SamplingConfig(
            temperature=temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            max_new_tokens=max_new_tokens,
            grammar=grammar,
        )


# -- the runners: one generation each, measured the same way -------------------------------------

@dataclass(frozen=True)
class BenchPrompt:
    ids: list[int]  # the chat template applied by the target's tokenizer
    messages: list[dict]  # what a server is sent (--anchor-url)
    grammar: GrammarSpec | None = None  # a tool-call prompt's: its tools, a call required


Runner = Callable[[BenchPrompt, SamplingConfig], dict]  # -> RunRecord's measured fields


def engine_runner(engine: SpeculativeEngine, method: str) -> Runner:
    def run(prompt: BenchPrompt, sampling: SamplingConfig) -> dict:
        state = engine.start(prompt.ids, sampling, method=method)
        try:
            while not state.finished:
                engine.step(state)
        finally:
            engine.release(state)
        stats = state.stats
        return {
            "token_ids": state.output_ids,
            "token_times_ms": list(stats.token_times_ms),
            "forwards": len(stats.steps) + int(state.prefilled),
            "steps": len(stats.steps),
            "speculative_steps": sum(1 for s in stats.steps if s.drafted),
            "accepted": stats.accepted,
            "drafted_by_pos": list(stats.drafted_by_pos),
            "accepted_by_pos": list(stats.accepted_by_pos),
            "draft_ms": stats.draft_ms,
            "verify_ms": stats.verify_ms,
            "gated_off": stats.gated_off,
            "finish_reason": stats.finish_reason,
            "engine_stats": stats.to_dict(),
        }

    return run


class TimingStreamer(BaseStreamer):
    """Records when `generate()` hands over each batch of new tokens (the prompt put is skipped)."""

    def __init__(self) -> None:
        self.times: list[float] = []  # perf_counter per put
        self.counts: list[int] = []  # tokens in that put (assisted steps put several)
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(now)
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        pass


def hf_runner(model, eos_ids: list[int], pad_id: int, **extra) -> Runner:
    """`model.generate()` with `extra` (prompt_lookup_num_tokens, assistant_model, ...)."""

    def run(prompt: BenchPrompt, sampling: SamplingConfig) -> dict:
        prompt_ids = prompt.ids
        input_ids = torch.tensor([prompt_ids], device=model.device)  # [1, n]
        kwargs = {"do_sample": False}
        if not is_greedy(sampling):
            kwargs = {"do_sample": True, "temperature": sampling.temperature,
                      "top_k": sampling.top_k, "top_p": sampling.top_p}
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        streamer = TimingStreamer()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer,
                max_new_tokens=sampling.max_new_tokens, eos_token_id=eos_ids,
                pad_token_id=pad_id, **kwargs, **extra,
            )
        times = [
            (t - t0) * 1000.0
            for t, n in zip(streamer.times, streamer.counts, strict=True)
            for _ in range(n)
        ]
        token_ids = out[0, len(prompt_ids) :].tolist()
        return {
            "token_ids": token_ids,
            "token_times_ms": times[: len(token_ids)],
            "forwards": len(streamer.counts),  # generate() puts once per target forward
            "finish_reason": "eos" if token_ids and token_ids[-1] in eos_ids else "length",
        }

    return run


def make_runners(
    engine: SpeculativeEngine, settings: BenchSettings, hf_model=None, hf_draft=None,
    other_formats: dict[str, SpeculativeEngine] | None = None, anchor: Runner | None = None,
) -> dict[str, Runner]:
    """Mode name -> runner, engine modes first, in the order the settings list them; then each
    mode in each other format (mode@format), the HF baselines and the anchor server."""
    runners = {mode: engine_runner(engine, mode) for mode in settings.modes}
    for fmt, other in (other_formats or {}).items():
        runners.update({f"{mode}{FORMAT_MARK}{fmt}": engine_runner(other, mode)
                        for mode in settings.modes})
    if settings.hf and hf_model is not None:
        eos = sorted(engine.eos_token_ids)
        pad = engine.tokenizer.pad_token_id if engine.tokenizer is not None else None
        pad = eos[0] if pad is None else pad
        runners["hf_plain"] = hf_runner(hf_model, eos, pad)
        runners["hf_prompt_lookup"] = hf_runner(
            hf_model, eos, pad, prompt_lookup_num_tokens=settings.hf_lookup_tokens
        )
        if hf_draft is not None:
            runners["hf_assisted"] = hf_runner(hf_model, eos, pad, assistant_model=hf_draft)
    if anchor is not None:
        runners[ANCHOR] = anchor
    return runners


# -- the harness --------------------------------------------------------------------------------


def select_segments(prompt_set: PromptSet, settings: BenchSettings) -> list[str]:
    """--segments, else every segment the prompt set does not keep for when it is asked for."""
    names = settings.segments or [n for n in prompt_set.segments if n not in prompt_set.on_request]
    unknown = [n for n in names if n not in prompt_set.segments]
    if unknown:
        known = ", ".join(prompt_set.segments)
        raise ValueError(f"unknown segment(s) {', '.join(unknown)}; the prompt set has: {known}")
    if not names:
        raise ValueError(f"no segment to run; name some of {', '.join(prompt_set.segments)}")
    return names


def bench_prompts(
    tokenizer, prompt_set: PromptSet, settings: BenchSettings
) -> dict[str, list[BenchPrompt]]:
    """The selected segments' prompts through the chat template, with the tools grammar on a
    tool-call segment's."""
    count = settings.prompts_per_segment or None
    out = {}
    for segment in select_segments(prompt_set, settings):
        texts = prompt_set.segments[segment][:count]
        tools = prompt_set.tools.get(segment, [None] * len(texts))[:count]
        out[segment] = [_prompt(tokenizer, messages(prompt_set.system, text), tool_list)
                        for text, tool_list in zip(texts, tools, strict=True)]
    return out


def prompt_modes(modes: list[str], prompt: BenchPrompt) -> list[str]:
    """The modes a prompt runs in: a baseline cannot decode under a grammar."""
    return [m for m in modes if prompt.grammar is None or not is_baseline(m)]


def warmup_prompts(prompts: dict[str, list[BenchPrompt]]) -> list[BenchPrompt]:
    """The first prompt without a grammar and the first with each tool list: an engine compiles a
    grammar on its first request, which stays out of the figures too."""
    firsts: dict[str, BenchPrompt] = {}
    for prompt in (p for seg_prompts in prompts.values() for p in seg_prompts):
        grammar = dataclasses.asdict(prompt.grammar) if prompt.grammar else None
        firsts.setdefault(json.dumps(grammar, sort_keys=True), prompt)
    return list(firsts.values())


def check_tool_call(text: str, grammar: GrammarSpec) -> tuple[dict | None, bool]:
    """The call in a tool-call reply, and whether it is schema-valid: it names one of the tools
    and its arguments validate against that tool's parameters. A call cut off is no call."""
    call = parse_tool_call(text)
    functions = {f["name"]: f for f in tool_functions(grammar)}
    name = call.get("name") if call else None
    if not isinstance(name, str) or name not in functions:
        return call, False
    parameters = functions[name].get("parameters") or {"type": "object", "properties": {}}
    try:
        jsonschema.validate(call.get("arguments"), parameters)
    except jsonschema.ValidationError:
        return call, False
    return call, True


def measure(runner: Runner, prompt: BenchPrompt, sampling: SamplingConfig, tokenizer) -> dict:
    """One generation's RunRecord fields; a tool-call prompt's call is checked."""
    measured = runner(prompt, sampling)
    if prompt.grammar is not None:
        text = tokenizer.decode(measured["token_ids"], skip_special_tokens=True)
        measured["tool_call"], measured["schema_valid"] = check_tool_call(text, prompt.grammar)
    return measured


def run_bench(
    engine: SpeculativeEngine,
    tokenizer,
    prompt_set: PromptSet,
    settings: BenchSettings,
    hf_model=None,
    hf_draft=None,
    progress: Callable[[str], None] = lambda msg: None,
    other_formats: dict[str, SpeculativeEngine] | None = None,
    anchor: Runner | None = None,
) -> tuple[list[RunRecord], list[str]]:
    """Every mode on every prompt; returns the run records and the modes in report order."""
    runners = make_runners(engine, settings, hf_model, hf_draft, other_formats, anchor)
    modes = list(runners)
    prompts = bench_prompts(tokenizer, prompt_set, settings)
    for prompt in warmup_prompts(prompts):  # one-off costs (allocator, first-call paths) too
        for mode in prompt_modes(modes, prompt):
            runners[mode](prompt, settings.sampling(0.0, settings.warmup_tokens, prompt.grammar))
    progress(f"warmed up {', '.join(modes)}")

    plan = [
        (temperature, repeat, segment, index, prompt)
        for temperature in settings.temperatures
        for repeat in range(settings.repeats)
        for segment, seg_prompts in prompts.items()
        for index, prompt in enumerate(seg_prompts)
    ]
    records: list[RunRecord] = []
    bar = progress_bar(len(plan), "bench engine", "prompt")  # on a terminal only
    for turn, (temperature, repeat, segment, index, prompt) in enumerate(plan):
        these = prompt_modes(modes, prompt)
        shift = turn % len(these)  # rotate the order, so no mode always runs first or last
        sampling = settings.sampling(temperature, grammar=prompt.grammar)
        done = [
            RunRecord(
                mode=mode, engine=not is_baseline(mode), segment=segment, prompt_index=index,
                repeat=repeat, temperature=temperature, prompt_tokens=len(prompt.ids),
                **measure(runners[mode], prompt, sampling, tokenizer),
            )
            for mode in these[shift:] + these[:shift]
        ]
        records += done
        with bar.external_write_mode(file=sys.stderr):  # the line above the bar
            progress(
                f"[{turn + 1}/{len(plan)}] T={temperature:g} repeat {repeat + 1} {segment} "
                f"#{index + 1}: "
                + ", ".join(f"{r.mode} {r.n_tokens} tok {_rate(r.decode_tok_s)}" for r in done)
            )
        bar.update()
    bar.close()
    return records, modes


def _prompt(tokenizer, chat: list[dict], tools: list[dict] | None) -> BenchPrompt:
    grammar = GrammarSpec(kind="tools", tools=tools, tool_choice="required") if tools else None
    return BenchPrompt(encode_chat(tokenizer, chat, tools), chat, grammar)


def _rate(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}/s"


# -- the report ---------------------------------------------------------------------------------


def machine_info(device) -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "load_avg_1m": os.getloadavg()[0],  # a shared machine: was something else running?
    }


def build_report(
    records: list[RunRecord],
    modes: list[str],
    settings: BenchSettings,
    prompt_set: PromptSet,
    engine: SpeculativeEngine,
    card: dict | None = None,
    started: datetime | None = None,
    load_at_start: float | None = None,
    formats: dict | None = None,
) -> dict:
    started = started or datetime.now(UTC)
    machine = machine_info(engine.device)
    machine["load_avg_1m_at_start"] = load_at_start
    return {
        "kind": "voiceagent engine bench",
        "started_utc": started.isoformat(timespec="seconds"),
        "finished_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "modes": modes,
        "settings": dataclasses.asdict(settings),
        "prompt_set": dataclasses.asdict(prompt_set),
        "engine_config": dataclasses.asdict(engine.config),
        "pair_card_hash": card.get("card_hash") if card else None,
        "pair_card": card,
        "machine": machine,
        "summary": summarise(records, modes, _rounding(modes, formats or {})),
        "formats": formats or {},
        "runs": [dataclasses.asdict(r) for r in records],
    }


def _rounding(modes: list[str], section: dict) -> list[str]:
    """Engine modes in a format whose runner's logits depend on the row count (HF's bf16 on a
    CPU; a lean format whose invariance probe failed here): informative in the lossless check."""
    identical = section.get("bit_identical", {})

    def fmt_of(mode: str) -> str | None:
        return mode.partition(FORMAT_MARK)[2] or section.get("chosen")

    return [m for m in modes if not is_baseline(m) and identical.get(fmt_of(m)) is False]


def report_header(report: dict) -> list[str]:
    cfg, s, m = report["engine_config"], report["settings"], report["machine"]
    return [
        f"- started {report['started_utc']}, target `{cfg['target']}`, draft "
        f"`{cfg['draft'] or 'none'}`, pair card `{(report['pair_card_hash'] or '–')[:12]}`",
        f"- {m['device']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"{m['torch_threads']} threads, {m['cpu']}, load average {_load(m)}",
        f"- prompts v{report['prompt_set']['version']} ({Path(report['prompt_set']['path']).name}),"
        f" max {s['max_new_tokens']} new tokens, {s['repeats']} repeat(s), seed {s['seed']},"
        f" top_k {s['top_k']}, top_p {s['top_p']}, HF prompt lookup {s['hf_lookup_tokens']} tokens",
        f"- modes: {', '.join(report['modes'])}",
    ] + ([f"- anchor: `{s['anchor_model']}` at {s['anchor_url']}"] if s.get("anchor_url") else [])


def _load(machine: dict) -> str:
    start = machine.get("load_avg_1m_at_start")
    end = f"{machine['load_avg_1m']:.1f}"
    return end if start is None else f"{start:.1f} at start, {end} at end"


def write_results(report: dict, markdown: str, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.fromisoformat(report["started_utc"]).strftime("%Y%m%dT%H%M%SZ")
    json_path, md_path = out / f"engine-{stamp}.json", out / f"engine-{stamp}.md"
    json_path.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    md_path.write_text(markdown)
    return json_path, md_path


# -- the command --------------------------------------------------------------------------------


NEEDS = {"draft": "a draft model", "eagle": "an EAGLE head"}  # by the engine setting naming it


def settings_from_args(args, cfg: Config) -> BenchSettings:
    """Flags over the config's sampling; `--quick` fills what the flags leave unset."""
    if args.methods:
        modes = [m.strip() for m in args.methods.split(",") if m.strip()]
    else:
        modes = (["off", "ngram"] + (["draft"] if cfg.engine.draft else [])
                 + (["eagle"] if cfg.engine.eagle else []))
    for mode in modes:
        try:
            methods.check(mode, "method")
        except ValueError as exc:  # it names the part it refuses: say which mode held it
            raise ValueError(f"mode {mode!r}: {exc}") from None
        setting = methods.model_setting(mode)
        if setting and not getattr(cfg.engine, setting):
            raise ValueError(f"mode {mode!r} needs {NEEDS[setting]}: "
                             f"--set engine.{setting}=NAME_OR_PATH")
    modes = [REFERENCE] + [m for m in dict.fromkeys(modes) if m != REFERENCE]  # off: the reference
    temperatures = (
        [float(t) for t in args.temperatures.split(",")] if args.temperatures
        else [0.0] if args.quick else [0.0, 0.8]
    )
    sampling = cfg.engine.sampling
    return BenchSettings(
        modes=modes,
        hf=not args.no_hf,
        temperatures=temperatures,
        max_new_tokens=args.max_new_tokens or (32 if args.quick else 64),
        repeats=args.repeats,
        segments=[s.strip() for s in args.segments.split(",")] if args.segments else None,
        prompts_per_segment=1 if args.quick else None,
        seed=args.seed,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        hf_lookup_tokens=args.hf_lookup_tokens,
        formats=_formats(args, cfg),
        quality=args.quality,
        anchor_url=args.anchor_url,
        anchor_model=args.anchor_model,
    )


def _formats(args, cfg: Config) -> list[str]:
    """--formats, else every format `auto` chooses among on a CPU, side by side."""
    if args.formats:
        names = [f.strip() for f in args.formats.split(",") if f.strip()]
        unknown = [f for f in names if f not in formats.ALL_FORMATS]
        if unknown:
            raise ValueError(f"unknown format(s) {', '.join(unknown)}; known: "
                             f"{', '.join(formats.ALL_FORMATS)}")
        return names
    on_cpu = cfg.engine.device == "cpu" or (
        cfg.engine.device == "auto" and not torch.cuda.is_available())
    return ["float32", "bfloat16", "int8", "q4"] if on_cpu and not args.quick else []


def run_engine_bench(cfg: Config, args) -> int:
    from voiceagent.llm_setup import build_runtime

    say = logs.write  # progress on stderr, above the bar
    settings = settings_from_args(args, cfg)
    prompt_set = load_prompt_set(args.prompts)
    segments = select_segments(prompt_set, settings)  # refuse unknown ones before loading models
    if settings.hf and all(seg in prompt_set.tools for seg in segments):
        settings.hf = False  # no prompt for HF generate(): do not load its fp32 target
        say("no HF generate() baselines: they cannot decode under the tools grammar")
    anchor = None
    if settings.anchor_url:  # an unreachable server fails now, not after minutes of loading
        try:
            anchor = connect(settings.anchor_url, settings.anchor_model)
        except AnchorError as exc:
            say(f"error: {exc}")
            return 2
        settings.anchor_model = anchor[1]
        say(f"anchor: {settings.anchor_url}, model {anchor[1]}")
    started, load_at_start = datetime.now(UTC), os.getloadavg()[0]
    drafters = settings.modes
    runtime = build_runtime(cfg.engine, cfg.paths.cache_dir, say, also=drafters)
    chosen = runtime.engine.runner.format
    # torch's thread count is the process's: the other formats run on the chosen one's.
    pinned = dataclasses.replace(cfg.engine, threads=torch.get_num_threads())
    others = {
        fmt_name: build_runtime(dataclasses.replace(pinned, format=fmt_name),
                                cfg.paths.cache_dir, say, also=drafters)
        for fmt_name in settings.formats if fmt_name != chosen
    }
    # HF generate() and --quality use the fp32 eager target: the reference a user starts from.
    reference = runtime if chosen == "float32" else others.get("float32")
    if reference is None and (settings.hf or settings.quality):
        reference = build_runtime(dataclasses.replace(pinned, format="float32"),
                                  cfg.paths.cache_dir, say, also=drafters)
    records, modes = run_bench(
        runtime.engine, runtime.target.tokenizer, prompt_set, settings,
        hf_model=reference.target.model if reference else None,
        hf_draft=reference.draft.model if reference and reference.draft else None,
        progress=say,
        other_formats={name: rt.engine for name, rt in others.items()},
        anchor=anchor_runner(*anchor, runtime.target.tokenizer) if anchor else None,
    )
    quality = {}
    if settings.quality:
        texts = [encode_chat(runtime.target.tokenizer, m) for m in heldout_conversations()]
        baseline = EagerRunner(reference.target.model)
        quality = {name: formats.agreement(baseline, rt.engine.runner, texts)
                   for name, rt in {chosen: runtime, **others}.items() if name != "float32"}
    everyone = {chosen: runtime, **others}
    section = format_section(
        {name: rt.engine.cost_model for name, rt in everyone.items()},
        chosen, {name: rt.engine.runner for name, rt in everyone.items()}, runtime.formats,
        quality)
    report = build_report(
        records, modes, settings, prompt_set, runtime.engine, runtime.card.to_dict(), started,
        load_at_start, section,
    )
    markdown = render_markdown(report["summary"], report_header(report), render_formats(section))
    json_path, md_path = write_results(report, markdown, args.out)
    print(markdown)
    say(f"wrote {json_path} and {md_path}")
    return 0
