"""Logging and progress bars for the command line, configured once by `voiceagent.cli.main`.

Our code and pipecat log with loguru; llm_engine, uvicorn and transformers with the standard
`logging` module, which is routed into loguru here, so one sink writes every line: loguru's usual
text format on stderr, or (`--log-json`) one JSON object per line with time, level, logger,
function, line, message and, with an exception, its traceback. `--log-level` is the level of that
sink (default INFO); other libraries' standard-logging records below WARNING stay dropped, as
they were before this was configured.

Quiet by design: a line a normal call writes at WARNING or above must mean something. The warnings
of libraries that are known to be harmless here are dropped at the sink, each with its reason, in
`HARMLESS` (the one place); uvicorn's access lines for the polled `/healthz` and `/metrics` are
DEBUG, every other request INFO.

Progress bars (tqdm) are drawn only when stderr is a terminal and the logs are text; elsewhere the
steps print their plain lines as before. Lines written with `write` (and log lines) appear above a
bar without breaking it.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import sys
import traceback
from datetime import UTC

from loguru import logger
from tqdm import tqdm

LEVELS = ["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
DEFAULT_LEVEL = "INFO"
STDLIB_LEVELS = {"TRACE": 5, "DEBUG": logging.DEBUG, "INFO": logging.INFO,
                 "WARNING": logging.WARNING, "ERROR": logging.ERROR,
                 "CRITICAL": logging.CRITICAL}
OUR_LOGGERS = ("voiceagent", "llm_engine", "audio", "__main__")  # standard-logging names

_state = {"bars": True}

# (logger name prefix, message pattern, why it is harmless here): dropped at the sink. A warning
# whose cause we can remove is fixed where it arises instead (see voiceagent/server/webrtc.py).
HARMLESS: tuple[tuple[str, re.Pattern, str], ...] = (
    ("pipecat.turns.user_stop",
     re.compile(r"VAD stop_secs \([\d.]+s\) differs from the recommended"),
     "our hangover (vad.stop_secs) is chosen, and the advice that follows (give the STT its own "
     "ttfs_p99_latency instead of pipecat's built-in one) is followed: see pipeline/stt.py"),
    ("pipecat.transports.smallwebrtc", re.compile(r"No (screen )?video transceiver is available"),
     "browser calls are audio-only: pipecat looks for the video tracks of every peer"),
)
POLLED_PATHS = frozenset({"/healthz", "/metrics"})  # their access lines are DEBUG


def harmless(record: dict) -> bool:
    """Whether a loguru record is one of `HARMLESS`."""
    name = record["name"] or ""
    return any(name.startswith(prefix) and pattern.search(record["message"])
               for prefix, pattern, _ in HARMLESS)


def _keep(record: dict) -> bool:
    return not harmless(record)


class InterceptHandler(logging.Handler):
    """A standard-logging handler that hands each record to loguru (loguru's recipe), naming the
    standard logger it came from (`logger` in the JSON lines)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        frame, depth = inspect.currentframe(), 0
        while frame is not None and (depth == 0 or frame.f_code.co_filename == logging.__file__):
            frame, depth = frame.f_back, depth + 1
        logger.opt(depth=depth, exception=record.exc_info).bind(logger=record.name).log(
            self.level_of(record, level), record.getMessage())

    def level_of(self, record: logging.LogRecord, level: str | int) -> str | int:
        return level


class AccessLogHandler(InterceptHandler):
    """uvicorn's access log: the polled paths (`POLLED_PATHS`: probes, scrapers) at DEBUG, so a
    server's log at INFO is its calls and its other requests."""

    def level_of(self, record: logging.LogRecord, level: str | int) -> str | int:
        # uvicorn's access record: args = (client, method, path with query, HTTP version, status)
        args = record.args if isinstance(record.args, tuple) else ()
        path = str(args[2]).partition("?")[0] if len(args) == 5 else ""
        return "DEBUG" if path in POLLED_PATHS and level == "INFO" else level


def json_line(record: dict) -> str:
    """One loguru record as a JSON object on one line."""
    out = {
        "time": record["time"].astimezone(UTC).isoformat(timespec="milliseconds"),
        "level": record["level"].name,
        "logger": record["extra"].get("logger", record["name"]),
        "function": record["function"],
        "line": record["line"],
        "message": record["message"],
    }
    exc = record["exception"]
    if exc is not None:
        out["exception"] = "".join(
            traceback.format_exception(exc.type, exc.value, exc.traceback)).rstrip()
    extra = {k: v for k, v in record["extra"].items() if k != "logger"}
    if extra:
        out["extra"] = extra
    return json.dumps(out, ensure_ascii=False, default=str)


def _json_sink(message) -> None:
    sys.stderr.write(json_line(message.record) + "\n")
    sys.stderr.flush()


def _text_sink(message) -> None:
    if bars_enabled():
        tqdm.write(str(message), file=sys.stderr, end="")  # above any bar, which is redrawn
    else:
        sys.stderr.write(str(message))
    sys.stderr.flush()


def configure(level: str = DEFAULT_LEVEL, json_lines: bool = False) -> None:
    """Route every log to one stderr sink at `level`; safe to call again (it replaces it)."""
    level = level.upper()
    if level not in STDLIB_LEVELS:
        raise ValueError(f"unknown log level {level!r}; one of {', '.join(LEVELS)}")
    _state["bars"] = not json_lines
    logger.remove()  # loguru's default handler (stderr, DEBUG) and any earlier configure's
    if json_lines:
        logger.add(_json_sink, level=level, format="{message}", colorize=False,
                   backtrace=False, diagnose=False, filter=_keep)
    else:
        # sys.stderr is looked up per line, so a replaced stream (pytest's capture) is followed.
        # diagnose=False: no variable values (a token, a caller's words) in a logged traceback.
        colour = sys.stderr.isatty() and "NO_COLOR" not in os.environ
        logger.add(_text_sink, level=level, colorize=colour, diagnose=False, filter=_keep)
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not isinstance(h, InterceptHandler)]
    root.addHandler(InterceptHandler())
    stdlib = STDLIB_LEVELS[level]
    root.setLevel(max(stdlib, logging.WARNING))  # other libraries: WARNING and up, as before
    for name in OUR_LOGGERS:
        logging.getLogger(name).setLevel(stdlib)
    _route_transformers()
    _route_uvicorn()


def _route_transformers() -> None:
    """transformers' logger writes to its own stderr handler: hand its records to the root (its
    own level, WARNING by default, still applies); its progress bars only on a terminal. Done
    now, though the CLI imports transformers only later (its logging module alone: 0.5 s,
    without torch): there is no hook to run this when it is imported."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    if bars_enabled():
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()


def _route_uvicorn() -> None:
    """uvicorn configures its loggers from `uvicorn.config.LOGGING_CONFIG` (the default
    `log_config` of every uvicorn.Config, the same dict object): point its two handlers at
    loguru, so its lines (access log included) come out in the same format and level (the
    access lines of `POLLED_PATHS` at DEBUG)."""
    try:
        import uvicorn.config
    except ImportError:
        return
    handlers = uvicorn.config.LOGGING_CONFIG["handlers"]
    handlers["default"] = {"()": f"{__name__}.InterceptHandler"}
    handlers["access"] = {"()": f"{__name__}.AccessLogHandler"}


# -- progress bars --------------------------------------------------------------------------------


def bars_enabled() -> bool:
    """Bars only on a terminal, and not under --log-json."""
    return _state["bars"] and sys.stderr.isatty()


def progress_bar(total: int | float | None = None, desc: str | None = None, unit: str = "it",
                 **kwargs) -> tqdm:
    """A tqdm bar on stderr when bars are enabled; otherwise a disabled one whose `update` and
    `close` do nothing (callers keep printing their plain lines through `write`)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not bars_enabled(),
                leave=False, dynamic_ncols=True, **kwargs)


def write(msg: str) -> None:
    """A line on stderr, above any progress bar (a plain print when there is none)."""
    if bars_enabled():
        tqdm.write(msg, file=sys.stderr)
    else:
        print(msg, file=sys.stderr, flush=True)
