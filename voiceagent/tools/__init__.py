"""Tools the agent can call: OpenAI-style function schemas, each with a Python handler.

A tool list is made of entries, each either a module path whose `TOOLS` list holds the entries
(`voiceagent.tools.demo`, the demo set), or one mapping `{name, description, parameters,
handler}` with `parameters` a JSON schema and `handler` an import path `package.module:function`,
and optionally:
- `ends_call: true`: the call hangs up once the bot has spoken its reply to it;
- `triggers`: regular expressions over the caller's words that make this tool the turn's required
  choice (a small model such as the embedded default seldom decides to call a tool by itself; a
  capable one needs no triggers);
- `read_only: true`: the tool changes nothing, so it may run on a reply prepared while the caller
  may still go on (its result is then ready when the turn is confirmed, and dropped with the
  reply when it is withdrawn); a tool with side effects runs only after the turn is confirmed;
- a string parameter's `pattern` (JSON schema) also tells the turn's end when a number read out
  is whole: where the caller's words trigger the tool and end on digits its pattern takes, and
  takes no longer number that goes on from them, the caller is done ("the order number is
  4821-3" is the five digits `^[0-9]{5}$` takes), where "555-123" could go on and is held
  (`takes_whole_number`);
- `say`: a spoken template for the result, e.g. "Order {order_id!d} is {status}.", filled from
  the result's fields (`!d` reads a number digit by digit, as one reads an order number on the
  phone) and spoken at once instead of the model's answer; when a field is missing (an order not
  found, an error) the model answers from the result as usual. A template is for results a
  fixed sentence says well; where the answer depends on the question ("is it open now?"), leave
  it out and let the model answer.
A handler is `async def handler(**arguments) -> dict | str`: plain Python, no framework types, so
a tool can be tested on its own.

`Tool.run` is the one way a tool runs: arguments checked against the schema first, the handler
bounded by a timeout, and any failure (bad arguments, a timeout, an exception) turned
into a result that says so, for the LLM to apologise from: a tool never takes the call down.
"""

from __future__ import annotations

import asyncio
import importlib
import re
import string
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

Handler = Callable[..., Awaitable[dict | str]]


class ToolError(ValueError):
    """A tool entry that cannot be loaded; the message names the entry and what is wrong."""


@dataclass(frozen=True)
class ToolResult:
    name: str
    ok: bool
    content: dict | str  # the handler's result, or {"error": ...} when it failed
    duration_ms: float

    @property
    def size(self) -> int:
        """Characters of the result as it enters the context."""
        return len(self.content if isinstance(self.content, str) else str(self.content))


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict
    handler: Handler
    ends_call: bool = False
    triggers: tuple[re.Pattern, ...] = ()
    read_only: bool = False
    say: str = ""
    patterns: tuple[re.Pattern, ...] = ()  # its string parameters' patterns

    def triggered_by(self, words: str) -> bool:
        return any(pattern.search(words) for pattern in self.triggers)

    def spoken(self, result: ToolResult) -> str | None:
        """The result in the `say` template, or None: no template, a failed call, or a field the
        template needs is not in the result."""
        if not self.say or not result.ok or not isinstance(result.content, dict):
            return None
        try:
            return _SPOKEN.format(self.say, **result.content)
        except (KeyError, IndexError, ValueError, AttributeError):
            return None

    @property
    def schema(self) -> dict:
        """OpenAI's function-tool shape."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}

    async def run(self, arguments: Any, timeout_s: float) -> ToolResult:
        start = time.perf_counter()

        def result(ok: bool, content: dict | str) -> ToolResult:
            return ToolResult(self.name, ok, content, (time.perf_counter() - start) * 1000)

        try:
            jsonschema.validate(arguments, self.parameters)
        except jsonschema.ValidationError as exc:
            return result(False, {"error": f"bad arguments: {exc.message}"})
        try:
            async with asyncio.timeout(timeout_s):
                return result(True, await self.handler(**arguments))
        except TimeoutError:
            return result(False, {"error": f"{self.name} took longer than {timeout_s:g} s"})
        except Exception as exc:  # noqa: BLE001 - a failing tool is reported, never fatal
            return result(False, {"error": f"{self.name} failed: {type(exc).__name__}: {exc}"})


GROUP_DIGITS = 4  # a number read out in groups goes on by a group of at most this many digits
_NEXT_GROUPS = tuple(d * n for d in "0123456789" for n in range(1, GROUP_DIGITS + 1))


def takes_whole_number(tools: Sequence[Tool], words: str, digits: str) -> bool:
    """Whether a tool that the caller's words trigger takes `digits` whole as a string
    argument: more digits than one group, which one of its patterns matches, and none matches
    followed by another group of up to GROUP_DIGITS digits (a pattern that takes 3 to 10 digits
    leaves "555-123" open). A single short group stays open: it may start a longer number."""
    if len(digits) <= GROUP_DIGITS:
        return False

    def whole(pattern: re.Pattern) -> bool:
        return bool(pattern.search(digits)) and \
            not any(pattern.search(digits + more) for more in _NEXT_GROUPS)

    return any(tool.triggered_by(words) and any(whole(p) for p in tool.patterns)
               for tool in tools)


class _SpokenFormatter(string.Formatter):
    """str.format, plus the conversion `!d`: a value read digit by digit ("4 8 2 1 3")."""

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion == "d":
            return " ".join(str(value))
        return super().convert_field(value, conversion)


_SPOKEN = _SpokenFormatter()


def load_tools(entries: list[str | dict]) -> list[Tool]:
    """The configured tools, imported and checked; raises ToolError naming the bad entry."""
    tools: list[Tool] = []
    for entry in entries:
        for spec in _expand(entry):
            tools.append(_tool(spec))
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ToolError(f"tools: more than one tool named {', '.join(duplicates)}")
    return tools


def _expand(entry: str | dict) -> list[dict]:
    if isinstance(entry, dict):
        return [entry]
    try:
        module = importlib.import_module(entry)
    except ImportError as exc:
        raise ToolError(f"tools: cannot import {entry!r}: {exc}") from None
    specs = getattr(module, "TOOLS", None)
    if not isinstance(specs, list):
        raise ToolError(f"tools: module {entry!r} has no TOOLS list")
    return specs


def _tool(spec: dict) -> Tool:
    name = spec.get("name")
    if not isinstance(name, str) or not name.replace("_", "").isalnum():
        raise ToolError(f"tools: {spec!r} needs a name of letters, digits and _")
    parameters = spec.get("parameters", {"type": "object", "properties": {}})
    try:
        jsonschema.Draft202012Validator.check_schema(parameters)
    except jsonschema.SchemaError as exc:
        raise ToolError(f"tools: {name}'s parameters are not a JSON schema: "
                        f"{exc.message}") from None
    if parameters.get("type") != "object":
        raise ToolError(f"tools: {name}'s parameters must be a JSON schema of type object")
    say = spec.get("say", "")
    if not isinstance(say, str):
        raise ToolError(f"tools: {name}'s say must be a text template, not {say!r}")
    return Tool(name, spec.get("description", ""), parameters, _handler(name, spec.get("handler")),
                bool(spec.get("ends_call", False)), _triggers(name, spec.get("triggers", [])),
                bool(spec.get("read_only", False)), say, _patterns(parameters))


def _patterns(parameters: dict) -> tuple[re.Pattern, ...]:
    """The patterns of the top-level string parameters, compiled by Python's re with ASCII
    classes (JSON schema's are ECMA-262, whose \\d is 0-9 only); one that Python cannot compile
    is left to the schema's own check and takes no part in ending a turn."""
    patterns = []
    for spec in parameters.get("properties", {}).values():
        if isinstance(spec, dict) and isinstance(spec.get("pattern"), str):
            try:
                patterns.append(re.compile(spec["pattern"], re.ASCII))
            except re.error:
                continue
    return tuple(patterns)


def _triggers(name: str, patterns: Any) -> tuple[re.Pattern, ...]:
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ToolError(f"tools: {name}'s triggers must be a list of regular expressions")
    try:
        return tuple(re.compile(p, re.IGNORECASE) for p in patterns)
    except re.error as exc:
        raise ToolError(f"tools: {name}'s trigger {exc.pattern!r} is not a regular expression: "
                        f"{exc}") from None


def _handler(name: str, path: Any) -> Handler:
    module_name, _, attr = str(path).partition(":")
    if not module_name or not attr:
        raise ToolError(f"tools: {name}'s handler must be 'package.module:function', "
                        f"not {path!r}")
    try:
        handler = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ToolError(f"tools: {name}'s handler {path!r} cannot be imported: "
                        f"{exc}") from None
    if not asyncio.iscoroutinefunction(handler):
        raise ToolError(f"tools: {name}'s handler {path!r} must be an async function")
    return handler
