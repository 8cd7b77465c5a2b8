"""Proposers, one class per method of `llm_engine.methods`: `off`, `ngram`, `draft`, `eagle` and
`grammar` (which combines with one of the others: "grammar+ngram")."""

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
    make_proposer,
    register,
    registered,
)

__all__ = [
    "EMPTY_DRAFT",
    "Draft",
    "ProposeContext",
    "Proposer",
    "make_proposer",
    "register",
    "registered",
]
