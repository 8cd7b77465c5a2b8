"""The proposer interface and the registry of implementations by name.

A proposer guesses the next k tokens; the target verifies them (see `llm_engine.verify`). Each
request owns its proposer, so proposer state (a draft KV cache, an n-gram index) is per request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from llm_engine.config import SamplingConfig, SpeculationConfig


@dataclass
class Draft:
    tokens: list[int]  # [k] drafted token ids, k may be shorter than asked (0: nothing to propose)
    q: torch.Tensor | None = None  # [k, vocab] draft probabilities; None for deterministic drafts


EMPTY_DRAFT = Draft([])


@dataclass
class ProposeContext:
    token_ids: list[int]  # every committed token of the request, prompt first; read-only
    k: int  # how many tokens to draft at most
    sampling: SamplingConfig  # the same transform the target uses
    generator: torch.Generator  # the request's generator, so seeded runs reproduce


class Proposer(Protocol):
    # True when sampled drafts are drawn from ctx.generator and carry q (a draft model): they are
    # then verified by rejection sampling on the same generator, whose stream order depends on K.
    # False for deterministic drafts (q is None), verified with per-position noise instead.
    samples_drafts: bool

    def begin(self, prompt_ids: list[int]) -> None:
        """Start a request. State whose tokens are a prefix of the prompt may be kept."""

    def propose(self, ctx: ProposeContext) -> Draft:
        """Draft up to ctx.k tokens following ctx.token_ids."""

    def update(self, num_accepted: int) -> None:
        """After verification of the last draft: roll back whatever was built on rejected tokens."""

    def release(self) -> None:
        """Free the proposer's memory (a draft KV cache)."""


ProposerFactory = Callable[[SpeculationConfig, "torch.nn.Module | None"], Proposer]
_REGISTRY: dict[str, ProposerFactory] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: the class's `create(spec, draft_model)` builds it under `name`."""

    def wrap(cls: type) -> type:
        _REGISTRY[name] = cls.create
        return cls

    return wrap


def proposer_names() -> list[str]:
    return sorted(_REGISTRY)


def make_proposer(
    name: str, spec: SpeculationConfig, draft_model: torch.nn.Module | None = None
) -> Proposer:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        known = ", ".join(proposer_names())
        raise ValueError(f"unknown proposer {name!r}; known: {known}") from None
    return factory(spec, draft_model)
