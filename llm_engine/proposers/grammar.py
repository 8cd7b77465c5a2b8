"""`grammar`: draft what a constrained request's grammar forces, with no model.

In structured output much of the text is fixed once the grammar state is known: brackets, keys
(JSON is held to its canonical layout), the only tool name, the rest of an enum value once it is
unambiguous, the EOS after a closed value. Serving engines only mask the target there; drafting
it instead costs a grammar walk and is accepted whenever the target's tokenisation matches.

Combined per step with another proposer ("grammar+ngram", "grammar+draft", ...): forced tokens
when there are any, else the other proposer drafts (under the mask, `proposers.base`). Alone
("grammar") it drafts nothing where the continuation is free. Forced drafts are deterministic
(q None, one-hot), so they are verified like n-gram drafts.
"""

from __future__ import annotations

from llm_engine.config import SpeculationConfig
from llm_engine.proposers.base import Draft, ProposeContext, Proposer, register
from llm_engine.proposers.off import OffProposer


@register("grammar")
class GrammarProposer(Proposer):
    combines = True

    def __init__(self, inner: Proposer):
        self.inner = inner
        self._delegated = False  # the inner proposer drafted the last proposal

    @classmethod
    def create(cls, spec: SpeculationConfig, model=None) -> GrammarProposer:
        return cls(OffProposer())

    @classmethod
    def around(cls, inner: Proposer) -> GrammarProposer:
        return cls(inner)

    # The engine reads these per request: they are the inner proposer's.
    @property
    def samples_drafts(self) -> bool:  # type: ignore[override]
        return self.inner.samples_drafts

    @property
    def uses_target_hidden(self) -> bool:  # type: ignore[override]
        return self.inner.uses_target_hidden

    def begin(self, prompt_ids: list[int]) -> None:
        self.inner.begin(prompt_ids)

    def propose(self, ctx: ProposeContext) -> Draft:
        forced = ctx.grammar.forced(ctx.k) if ctx.grammar is not None else []
        self._delegated = not forced
        if forced:
            return Draft(forced, forced=len(forced))
        return self.inner.propose(ctx)

    def observe_target(self, token_ids: list[int], hidden) -> None:
        self.inner.observe_target(token_ids, hidden)

    def update(self, num_accepted: int) -> None:
        if self._delegated:  # the inner proposer's state was built on its own draft only
            self.inner.update(num_accepted)

    def release(self) -> None:
        self.inner.release()
