"""Prompt sets: the versioned prompts benchmarks run and formats are checked on."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import yaml

from voiceagent.config import PROMPTS_DIR

DEFAULT_PROMPTS = PROMPTS_DIR / "engine_bench_v2.yaml"
# The draft-training set: its held-out items are text no trained draft has seen.
HELDOUT_PROMPTS = PROMPTS_DIR / "distill_v1.yaml"


@dataclass
class PromptSet:
    version: int
    system: str
    segments: dict[str, list[str | list[dict]]]  # a user message, or a whole conversation
    path: str
    sha256: str
    # Segments whose prompts must end in a tool call: each prompt's OpenAI function tools.
    tools: dict[str, list[list[dict]]] = field(default_factory=dict)
    on_request: list[str] = field(default_factory=list)  # segments run only when named


def load_prompt_set(path: str | Path = DEFAULT_PROMPTS) -> PromptSet:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"prompt set not found: {path}") from None
    data = yaml.safe_load(raw) or {}
    segments = data.get("segments")
    if segments is None and isinstance(data.get("categories"), dict):
        segments = _heldout_segments(data["categories"])
    if not isinstance(segments, dict) or not all(
        isinstance(v, list) and v and all(isinstance(p, (str, list, dict)) for p in v)
        for v in segments.values()
    ):
        raise ValueError(f"{path}: 'segments' must map segment names to lists of prompts")
    tools = {str(k): _prompt_tools(path, str(k), v, data.get("tools") or {})
             for k, v in segments.items() if any(isinstance(p, dict) for p in v)}
    on_request = [str(name) for name in data.get("on_request") or []]
    if unknown := [name for name in on_request if name not in segments]:
        raise ValueError(f"{path}: on_request names unknown segment(s) {', '.join(unknown)}")
    return PromptSet(
        version=int(data.get("version", 0)),
        system=str(data.get("system") or ""),
        segments={str(k): [_prompt(p) for p in v] for k, v in segments.items()},
        path=str(path),
        sha256=hashlib.sha256(raw).hexdigest(),
        tools=tools,
        on_request=on_request,
    )


def _prompt(item: str | list | dict) -> str | list[dict]:
    return item.get("messages") or item["prompt"] if isinstance(item, dict) else item


def _prompt_tools(path: Path, segment: str, items: list, defined: dict) -> list[list[dict]]:
    """A tool-call segment's tools per prompt: every item is {prompt or messages, tools: [names
    of the set's `tools`]}."""
    out = []
    for item in items:
        names = item.get("tools") if isinstance(item, dict) else None
        if not names or not ("prompt" in item or "messages" in item):
            raise ValueError(f"{path}: every prompt of segment {segment!r} needs 'prompt' or "
                             f"'messages', and 'tools'")
        if unknown := [n for n in names if n not in defined]:
            raise ValueError(f"{path}: segment {segment!r} names unknown tool(s) "
                             f"{', '.join(unknown)}")
        out.append([_checked_tool(path, name, defined[name]) for name in names])
    return out


def _checked_tool(path: Path, name: str, tool: dict) -> dict:
    # A broken schema fails here, not as a schema-invalid call after minutes of benchmarking.
    parameters = tool.get("function", tool).get("parameters", {})
    try:
        jsonschema.Draft202012Validator.check_schema(parameters)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"{path}: tool {name}'s parameters: {exc.message}") from None
    return tool


def _heldout_segments(categories: dict) -> dict[str, list]:
    """A draft-training prompt set (configs/prompts/distill_v1.yaml) is benchmarked on its
    held-out items only: the ones the draft never trained on."""
    segments = {}
    for name, items in categories.items():
        kept = [item.get("messages") or item["prompt"] for item in items
                if isinstance(item, dict) and item.get("heldout")]
        if kept:
            segments[str(name)] = kept
    return segments


def messages(system: str, prompt: str | list[dict]) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system}] if system else []
    turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return [*head, *turns]


def heldout_conversations(path: str | Path = HELDOUT_PROMPTS) -> list[list[dict[str, str]]]:
    """Every held-out prompt of a draft-training set as chat messages."""
    prompt_set = load_prompt_set(path)
    return [messages(prompt_set.system, prompt)
            for prompts in prompt_set.segments.values() for prompt in prompts]
