"""Prompt sets: the versioned prompts benchmarks run and formats are checked on."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import yaml

from voiceagent.config import REPO_ROOT

DEFAULT_PROMPTS = REPO_ROOT / "configs" / "prompts" / "engine_bench_v1.yaml"
# The draft-training set: its held-out items are text no trained draft has seen.
HELDOUT_PROMPTS = REPO_ROOT / "configs" / "prompts" / "distill_v1.yaml"


@dataclass
class PromptSet:
    version: int
    system: str
    segments: dict[str, list[str | list[dict]]]  # a user message, or a whole conversation
    path: str
    sha256: str


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
        isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v)
        for v in segments.values()
    ):
        raise ValueError(f"{path}: 'segments' must map segment names to lists of prompts")
    return PromptSet(
        version=int(data.get("version", 0)),
        system=str(data.get("system") or ""),
        segments={str(k): list(v) for k, v in segments.items()},
        path=str(path),
        sha256=hashlib.sha256(raw).hexdigest(),
    )



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
