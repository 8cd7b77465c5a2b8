"""The `voiceagent` command line. Heavy imports (torch, pipecat, the models) happen inside each
subcommand, so `voiceagent --help` and a bad flag answer at once."""

from __future__ import annotations

import argparse
import sys

from llm_engine import methods
from llm_engine.errors import IncompatiblePairError, ModelLoadError
from voiceagent import logs
from voiceagent.config import ConfigError, load_config
from voiceagent.malloc import cap_arenas
from voiceagent.models import ModelNotFound


def _method(name: str) -> str:
    from voiceagent.config import did_you_mean, setting_choices

    try:
        methods.check(name)
    except ValueError as exc:
        guess = did_you_mean(name, setting_choices(("engine", "speculation", "method")))
        raise argparse.ArgumentTypeError(f"{exc}; {guess}" if guess else str(exc)) from None
    return name


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (default: configs/default.yaml)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set engine.speculation.method=off (repeatable)",
    )


def _log_args(p: argparse.ArgumentParser, top: bool = False) -> None:
    """--log-level and --log-json, before a command (`voiceagent --log-json serve`) or after it;
    after it they default to SUPPRESS, so as not to overwrite one given before it."""
    p.add_argument("--log-level", type=str.upper, choices=logs.LEVELS, metavar="LEVEL",
                   default=logs.DEFAULT_LEVEL if top else argparse.SUPPRESS,
                   help=f"log level: {', '.join(logs.LEVELS)} (default: {logs.DEFAULT_LEVEL}); "
                   "ours, pipecat's, uvicorn's and the engine's logs alike")
    p.add_argument("--log-json", action="store_true",
                   default=False if top else argparse.SUPPRESS,
                   help="logs as one JSON object per line on stderr (time, level, logger, "
                   "message, exception) instead of text; no progress bars")


def _command(sub, name: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand that takes --config, --set, --log-level and --log-json."""
    p = sub.add_parser(name, **kwargs)
    _config_args(p)
    _log_args(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="voiceagent",
        description="Real-time voice agent with an in-process speculative-decoding LLM engine.",
    )
    _log_args(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of the commands below; COMMAND --help for its flags")

    p = _command(sub, "serve", help="run the call server (browser WebRTC, Twilio, dashboard)")
    p.add_argument("--host", default=None, help="bind address (default from config: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default from config: 7860)")
    p.add_argument("--insecure-public", action="store_true",
                   help="listen off loopback without server.token (and take unsigned Twilio "
                   "calls): anyone who reaches the port can place calls and read transcripts")

    p = _command(sub, "call", help="simulate a phone call from a WAV file through the pipeline")
    p.add_argument("--wav", required=True, help="caller audio (WAV)")
    p.add_argument("--out", help="write the bot's audio here (WAV)")
    p.add_argument("--json", action="store_true", help="print the turn records as JSON")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--realtime", action="store_true", help="stream at real-time pace (default)")
    pace.add_argument("--fast", action="store_true",
                      help="stream without real-time pacing: a smoke run; later utterances then "
                      "arrive while the bot still answers, so clocks are not meaningful")

    p = _command(sub, "chat", help="generate one reply with the engine only (no audio)")
    p.add_argument("prompt", help="the user's message")
    p.add_argument("--method", type=_method, metavar="METHOD",
                   help=f"speculation method: {methods.help_text()} (default from config: "
                   "engine.speculation.method)")
    p.add_argument("--draft", help="draft model name or path (implies --method draft)")
    p.add_argument("--temperature", type=float,
                   help="sampling temperature, 0 for greedy (default from config)")
    p.add_argument("--max-new-tokens", type=int,
                   help="most tokens to generate (default from config)")
    p.add_argument("--seed", type=int, help="sampling seed (default from config)")
    p.add_argument("--json", action="store_true",
                   help="print text, token_ids, finish_reason, stats and the engine config as "
                   "one JSON object instead of streaming the reply")

    p = sub.add_parser("bench", help="benchmarks (JSON + Markdown under results/)",
                       description="Benchmarks; each writes JSON and Markdown under results/. "
                       "`voiceagent bench KIND --help` lists a kind's flags.")
    _log_args(p)
    kinds = p.add_subparsers(dest="what", required=True, metavar="KIND",
                             help="engine, call, serve, asr or cue")
    _bench_engine_args(_command(
        kinds, "engine", help="engine modes vs HF generate(), per weight format",
        description="Engine modes in each weight format against HF generate() fp32 baselines, "
        "side by side, per prompt segment."))
    _bench_call_args(_command(
        kinds, "call", help="scripted multi-turn calls, variants side by side",
        description="The same scripted calls through the whole pipeline under several "
        "variants, side by side."))
    _bench_serve_args(_command(
        kinds, "serve", help="the server under simulated Twilio callers",
        description="The call server under simulated Twilio callers: round trip, barge-in, "
        "simultaneous calls, memory; or (--knee) the capacity knee."))

    p = _command(
        kinds, "asr", help="Whisper on the speech window vs the padded 30 s window",
        description="Word error and run time of Whisper on the speech window against the "
        "padded 30 s window, on the project's caller phrases spoken at several rates.")
    p.add_argument("--rates", help="Piper length_scale values, comma-separated "
                   "(default: 0.8,1.0,1.3)")
    _bench_out(p)

    p = _command(
        kinds, "cue", help="the turn cue's scores on finished and unfinished phrases",
        description="The in-process target's end-of-utterance scores (turn.unfinished_logprob) "
        "on phrases labelled finished or unfinished: which the configured threshold gets wrong, "
        "and what each threshold of a sweep gets wrong for this target.")
    p.add_argument("--phrases", help="labelled phrases YAML (default: "
                   "configs/prompts/turn_cue_v1.yaml)")
    _bench_out(p)

    _command(sub, "doctor", help="check the environment and load every configured model")

    p = _command(sub, "report", help="the dashboard's figures as a static HTML or Markdown "
                 "report with PNG plots, from the turn store")
    p.add_argument("--out", required=True,
                   help="report file, .html or .md; the plots go to <stem>_files/ beside it")
    p.add_argument("--since", help="only turns since an ISO date/time (2026-11-30, "
                   "2026-11-30T06:00, local time) or a duration back from now (90m, 24h, 7d); "
                   "default: all turns")
    p.add_argument("--turn", action="append", metavar="CALL_ID:N", default=[],
                   help="add this turn as it sounded: its call's recording (store.audio) with "
                   "its stages marked, as a PNG (repeatable)")
    return parser


def _bench_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results", help="results folder (default: results)")


def _bench_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default=None, help="prompt set YAML "
                   "(default: configs/prompts/engine_bench_v2.yaml)")
    p.add_argument("--methods", help="speculation methods, comma-separated: off, ngram, draft, "
                   "eagle, grammar or grammar+<one>, e.g. grammar+ngram (default: off,ngram and "
                   "draft when engine.draft is set, eagle when engine.eagle is; off always runs)")
    p.add_argument("--temperatures", help="comma-separated (default: 0,0.8; --quick: 0)")
    p.add_argument("--max-new-tokens", type=int, help="per reply (default: 64; --quick: 32; "
                   "at least 128 for a tool call)")
    p.add_argument("--repeats", type=int, default=1,
                   help="passes over the prompt set; with --batch, runs of each way (medians)")
    p.add_argument("--segments", help="comma-separated segment names (default: all but the "
                   "prompt set's on-request ones; tool_call, whose prompts are decoded under the "
                   "tools grammar and must call a tool, runs only when named)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, the same for every mode")
    p.add_argument("--hf-lookup-tokens", type=int, default=10,
                   help="HF generate(prompt_lookup_num_tokens=N) (default: 10)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate() baselines")
    p.add_argument("--formats", help="weight formats to run every mode in, comma-separated: "
                   "float32, bfloat16, float16, int8, q4 (default on a CPU: "
                   "float32,bfloat16,int8,q4)")
    p.add_argument("--anchor-url", help="an OpenAI-compatible server's /v1 URL (vLLM, SGLang, "
                   "llama.cpp) timed on the same prompts as mode `anchor`")
    p.add_argument("--anchor-model", help="the model to ask the anchor for "
                   "(default: the first it serves)")
    p.add_argument("--quality", action="store_true", help="each format's teacher-forced top-1 "
                   "agreement and log-prob difference against fp32")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 prompt per segment, 32 tokens, temperature 0")
    p.add_argument("--batch", help="sessions decoding at once, comma-separated (e.g. 1,2,4): "
                   "aggregate and per-session tok/s, one step each against one shared forward, "
                   "for each of --methods (default: off and engine.speculation.method)")
    p.add_argument("--stop-at-eos", action="store_true", help="with --batch, end each session "
                   "at its EOS (default: every session decodes all --max-new-tokens)")
    _bench_out(p)


def _bench_call_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", help="variants, comma-separated: "
                   "METHOD[+prepare][+smart_turn][:key=value...] (default: "
                   "off,ngram,off+prepare,ngram+prepare; with --backend: off,ngram and each NAME)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the script")
    p.add_argument("--backend", action="append", metavar="NAME=URL",
                   help="a remote OpenAI-compatible server (vLLM, SGLang, serve's /v1) as the "
                   "LLM of the variants named NAME (repeatable)")
    p.add_argument("--script", help="scripted calls YAML "
                   "(default: configs/prompts/call_bench_v3.yaml)")
    _bench_out(p)


def _bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=int, default=5, help="turns of the timed call (default: 5)")
    p.add_argument("--calls", help="simultaneous calls to try, comma-separated (default: 1,2,3; "
                   "--knee: 1,2,3,4,5,6)")
    p.add_argument("--knee", action="store_true", help="the capacity knee, speculation off and "
                   "on (per number of callers at once)")
    p.add_argument("--threshold-ms", type=float, default=1500.0,
                   help="--knee: clock 3 every turn must stay under (default: 1500)")
    p.add_argument("--compare-shared-forwards", action="store_true",
                   help="--knee: each method with one engine forward per call in turn and with "
                   "every call's rows in one shared forward (engine.shared_forwards), side by side")
    p.add_argument("--repeats", type=int, default=1,
                   help="--knee: passes over every level, the methods alternating; each level's "
                   "turns pooled (default: 1)")
    p.add_argument("--soak", type=int, default=20,
                   help="calls in a row for the memory figure (default: 20)")
    _bench_out(p)


def cmd_doctor(args: argparse.Namespace) -> int:
    from voiceagent.commands.doctor import run_doctor

    cfg = load_config(args.config, args.overrides)
    report = run_doctor(cfg)
    if report.problems:
        print(f"{len(report.problems)} problem(s):", file=sys.stderr)
        for check in report.problems:
            print(f"  {check.name}: {check.detail}", file=sys.stderr)
        return 1
    print("all checks passed")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from voiceagent.commands.chat import run_chat

    return run_chat(load_config(args.config, args.overrides), args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "asr":
        from voiceagent.bench.asr import run_asr_bench

        return run_asr_bench(load_config(args.config, args.overrides), args)
    if args.what == "serve":
        from voiceagent.bench.serve import run_serve_bench

        return run_serve_bench(load_config(args.config, args.overrides), args)
    if args.what == "cue":
        from voiceagent.bench.cue import run_cue_bench

        return run_cue_bench(load_config(args.config, args.overrides), args)
    if args.what == "call":
        from voiceagent.bench.call import run_call_bench

        return run_call_bench(load_config(args.config, args.overrides), args)
    from voiceagent.bench.engine import run_engine_bench
    from voiceagent.prompt_sets import DEFAULT_PROMPTS

    args.prompts = args.prompts or str(DEFAULT_PROMPTS)
    if args.stop_at_eos and not args.batch:
        raise SystemExit("--stop-at-eos goes with --batch (the other runs end at EOS)")
    if args.batch:
        from voiceagent.bench.batch import run_batch_bench

        return run_batch_bench(load_config(args.config, args.overrides), args)
    return run_engine_bench(load_config(args.config, args.overrides), args)


def cmd_serve(args: argparse.Namespace) -> int:
    from voiceagent.server.serve import run_serve

    return run_serve(load_config(args.config, args.overrides), args)


def cmd_call(args: argparse.Namespace) -> int:
    from voiceagent.commands.call import run_call

    return run_call(load_config(args.config, args.overrides), args)


def cmd_report(args: argparse.Namespace) -> int:
    from voiceagent.commands.report import run_report

    return run_report(load_config(args.config, args.overrides), args)


COMMANDS = {
    "serve": cmd_serve, "call": cmd_call, "doctor": cmd_doctor,
    "chat": cmd_chat, "bench": cmd_bench, "report": cmd_report,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cap_arenas()  # before any model starts a thread
    logs.configure(args.log_level, args.log_json)
    handler = COMMANDS[args.command]
    try:
        return handler(args)
    except (ConfigError, ModelNotFound, ModelLoadError, IncompatiblePairError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
