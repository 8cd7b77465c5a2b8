"""The CLI's flags: each bench kind only its own, help on every flag, --log-level and --log-json
(one JSON object per line), progress bars only on a terminal."""

import argparse
import io
import json
import logging
import subprocess
import sys

import pytest
from loguru import logger

from voiceagent import cli, logs
from voiceagent.cli import build_parser, main


@pytest.fixture(autouse=True)
def _default_logging():
    yield
    logs.configure()  # what the next CLI run would set up; not this test's JSON or level


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _subparsers(parser: argparse.ArgumentParser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, (*path, name))


def test_each_bench_kind_lists_only_its_own_flags(capsys):
    engine = _help(capsys, "bench", "engine")
    call = _help(capsys, "bench", "call")
    serve = _help(capsys, "bench", "serve")
    for flag in ("--calls", "--soak", "--knee", "--turns", "--threshold-ms", "--backend",
                 "--script"):
        assert flag not in engine
    assert "--quick" in engine and "--formats" in engine and "--methods" in engine
    for flag in ("--calls", "--knee", "--quick", "--formats", "--anchor-url", "--segments"):
        assert flag not in call
    assert "--backend" in call and "--script" in call and "--methods" in call
    for flag in ("--methods", "--quick", "--backend", "--formats"):
        assert flag not in serve
    assert "--knee" in serve and "--soak" in serve and "--repeats" in serve  # the knee's passes
    for text in (engine, call, serve):
        assert "--config" in text and "--log-level" in text and "--log-json" in text


def test_every_flag_of_every_command_has_help():
    parsers = list(_subparsers(build_parser()))
    assert {p for p, _ in parsers} >= {("serve",), ("call",), ("chat",), ("doctor",),
                                       ("report",), ("bench", "engine"), ("bench", "call"),
                                       ("bench", "serve"), ("bench", "cue")}
    missing = [(path, action.option_strings or action.dest)
               for path, parser in parsers for action in parser._actions
               if not isinstance(action, argparse._HelpAction) and not action.help]
    assert missing == []


@pytest.mark.parametrize("argv", [
    ["bench", "engine", "--quick"],
    ["bench", "engine", "--methods", "off,ngram,draft,eagle", "--formats", "float32,bfloat16",
     "--quality"],
    ["bench", "engine", "--segments", "tool_call", "--methods", "off,grammar,grammar+ngram",
     "--no-hf", "--max-new-tokens", "160"],
    ["bench", "engine", "--prompts", "configs/prompts/distill_v1.yaml", "--methods", "off",
     "--temperatures", "0", "--repeats", "2", "--seed", "3", "--hf-lookup-tokens", "5"],
    ["bench", "engine", "--anchor-url", "http://127.0.0.1:8100/v1", "--anchor-model", "m",
     "--set", "engine.runner=compiled", "--out", "x"],
    ["bench", "call", "--repeats", "2", "--methods", "off:vad.stop_secs=0.3,ngram"],
    ["bench", "call", "--backend", "vllm=http://127.0.0.1:8100/v1", "--script", "s.yaml"],
    ["bench", "serve", "--turns", "5", "--calls", "1,2,3", "--soak", "20"],
    ["bench", "serve", "--knee", "--turns", "2", "--calls", "1,2,3,4,5,6", "--set",
     "server.max_calls=6", "--threshold-ms", "1200"],
    ["bench", "cue", "--phrases", "configs/prompts/turn_cue_v1.yaml", "--set",
     "engine.target=smollm2-135m-instruct"],
])
def test_the_documented_bench_invocations_still_parse(argv):
    args = build_parser().parse_args(argv)
    assert args.command == "bench" and args.what == argv[1]
    assert args.log_level == "INFO" and args.log_json is False


@pytest.mark.parametrize("argv", [
    ["bench", "serve", "--quick"], ["bench", "engine", "--calls", "1"],
    ["bench", "call", "--knee"], ["bench", "cue", "--methods", "off"], ["bench"],
])
def test_a_flag_of_another_bench_kind_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2


@pytest.mark.parametrize("argv", [
    ["serve"], ["call", "--wav", "a.wav"], ["chat", "hi"], ["doctor"], ["report", "--out", "r.md"],
    ["bench", "engine"], ["bench", "call"], ["bench", "serve"],
])
def test_log_flags_on_every_command_before_or_after_it(argv):
    parser = build_parser()
    after = parser.parse_args([*argv, "--log-level", "warning", "--log-json"])
    assert (after.log_level, after.log_json) == ("WARNING", True)
    before = parser.parse_args(["--log-level", "DEBUG", "--log-json", *argv])
    assert (before.log_level, before.log_json) == ("DEBUG", True)
    if argv[0] == "bench":
        between = parser.parse_args(["bench", "--log-json", *argv[1:]])
        assert (between.log_level, between.log_json) == ("INFO", True)
    plain = parser.parse_args(argv)
    assert (plain.log_level, plain.log_json) == ("INFO", False)


def _fake_command(args) -> int:
    logger.info("hello from loguru")
    logger.bind(call_id="c1").warning("a warning")
    logging.getLogger("llm_engine.fake").info("from the standard library")
    logging.getLogger("some.other.library").info("dropped: below WARNING")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("it failed")
    return 0


def test_log_json_writes_one_parseable_object_per_line(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "doctor", _fake_command)
    assert main(["doctor", "--log-json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    by_message = {line["message"]: line for line in lines}
    assert set(by_message) == {"hello from loguru", "a warning", "from the standard library",
                               "it failed"}
    hello = by_message["hello from loguru"]
    assert hello["level"] == "INFO" and hello["logger"] == __name__
    assert hello["time"].endswith("+00:00") and hello["function"] == "_fake_command"
    assert by_message["a warning"]["extra"] == {"call_id": "c1"}
    std = by_message["from the standard library"]
    assert std["logger"] == "llm_engine.fake" and std["level"] == "INFO"
    failed = by_message["it failed"]
    assert failed["level"] == "ERROR" and "RuntimeError: boom" in failed["exception"]
    assert "exception" not in hello


def test_log_level_warning_hides_info(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "doctor", _fake_command)
    assert main(["--log-level", "WARNING", "doctor"]) == 0
    err = capsys.readouterr().err
    assert "a warning" in err and "it failed" in err and "RuntimeError: boom" in err
    assert "hello from loguru" not in err and "from the standard library" not in err


def test_text_logs_by_default_at_info(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "doctor", _fake_command)
    logger.debug("before the CLI configured anything")
    assert main(["doctor"]) == 0
    err = capsys.readouterr().err
    assert "| INFO     |" in err and "hello from loguru" in err
    assert "from the standard library" in err and "dropped" not in err
    logger.debug("not shown at INFO")
    assert "not shown" not in capsys.readouterr().err


def test_no_bars_off_a_terminal_only_plain_lines(capsys):
    logs.configure()
    assert not logs.bars_enabled()  # pytest captures stderr: not a terminal
    bar = logs.progress_bar(3, "steps")
    for i in range(3):
        logs.write(f"[{i + 1}/3] step")
        bar.update()
    bar.close()
    assert capsys.readouterr().err == "[1/3] step\n[2/3] step\n[3/3] step\n"


def test_transformers_imported_after_the_logs_are_set_up_is_routed_and_draws_no_bar():
    # The CLI configures the logs before any command imports transformers (in a fresh process).
    code = ("import logging, voiceagent.logs as logs; logs.configure(); "
            "from transformers.utils import logging as hf; "
            "print(hf.is_progress_bar_enabled(), logging.getLogger('transformers').propagate)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout  # stderr is a pipe here


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_on_a_terminal_but_not_with_json(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    logs.configure()
    assert logs.bars_enabled()
    bar = logs.progress_bar(2, "steps", "prompt")
    logs.write("a line above the bar")
    bar.update(2)
    bar.close()
    shown = terminal.getvalue()
    assert "a line above the bar\n" in shown and "steps:   0%" in shown and "0/2" in shown
    logs.configure(json_lines=True)
    assert not logs.bars_enabled()


def test_the_help_names_every_speculation_method(capsys):
    from llm_engine import methods

    with pytest.raises(SystemExit):
        cli.main(["chat", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert all(name in shown for name in methods.names()) and "grammar+<one>" in shown


def test_the_cli_answers_help_without_importing_torch():
    code = "import sys, voiceagent.cli; print('torch' in sys.modules, 'pipecat' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout


def test_a_bad_method_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["chat", "hi", "--method", "magic"])
    assert exited.value.code == 2
    assert "unknown speculation method 'magic'" in capsys.readouterr().err


def test_a_mistyped_method_flag_suggests_the_nearest(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["chat", "hi", "--method", "eagel"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().endswith("did you mean 'eagle'?")
