"""`off`: never drafts, so every step is plain decoding through the speculative code path."""

from __future__ import annotations

from llm_engine.config import SpeculationConfig
from llm_engine.proposers.base import EMPTY_DRAFT, Draft, ProposeContext, register


@register("off")
class OffProposer:
    samples_drafts = False
    uses_target_hidden = False

    @classmethod
    def create(cls, spec: SpeculationConfig, draft_model=None) -> OffProposer:
        return cls()

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, ctx: ProposeContext) -> Draft:
        return EMPTY_DRAFT

    def update(self, num_accepted: int) -> None:
        pass

    def release(self) -> None:
        pass
