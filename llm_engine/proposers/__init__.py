"""Proposers, registered by name: `off`, `ngram`, `draft` and `eagle`."""

from llm_engine.proposers import draft_model, eagle, ngram, off  # noqa: F401  (imports register them)
from llm_engine.proposers.base import (
    EMPTY_DRAFT,
    Draft,
    ProposeContext,
    Proposer,
    make_proposer,
    model_settings,
    proposer_names,
    register,
)

__all__ = [
    "EMPTY_DRAFT",
    "Draft",
    "ProposeContext",
    "Proposer",
    "make_proposer",
    "model_settings",
    "proposer_names",
    "register",
]
