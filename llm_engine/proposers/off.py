"""`off`: never drafts, so every step is plain decoding through the speculative code path."""

from __future__ import annotations

from llm_engine.proposers.base import EMPTY_DRAFT, Draft, ProposeContext, Proposer, register


@register("off")
class OffProposer(Proposer):
    def propose(self, ctx: ProposeContext) -> Draft:
        return EMPTY_DRAFT
