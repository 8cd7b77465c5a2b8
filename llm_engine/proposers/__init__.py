"""Proposers, registered by name: `off`, `ngram`, `draft`, `eagle` and `grammar` (which
combines with one of the others: "grammar+ngram")."""

from llm_engine.proposers import (  # noqa: F401  (imports register them)
    draft_model,
    eagle,
    grammar,
    ngram,
    off,
)
from llm_engine.proposers.base import (
    EMPTY_DRAFT,
    Draft,
    ProposeContext,
    Proposer,
    check_method,
    make_proposer,
    model_setting,
    model_settings,
    proposer_names,
    register,
)

__all__ = [
    "EMPTY_DRAFT",
    "Draft",
    "ProposeContext",
    "Proposer",
    "check_method",
    "make_proposer",
    "model_setting",
    "model_settings",
    "proposer_names",
    "register",
]
