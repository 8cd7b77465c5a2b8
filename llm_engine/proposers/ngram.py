"""`ngram`: prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; HF
`prompt_lookup_num_tokens`).

The last n committed tokens are looked up in the prompt plus the generated text; the tokens that
followed their most recent earlier occurrence are the draft. The longest n in
[ngram_min, ngram_max] that matches wins. The draft is deterministic, so q is None (one-hot):
verification stays exact whatever history penalties do to p, but they reject what this drafts (a
repeat), so with them on the gate soon turns speculation off.
"""

from __future__ import annotations

from llm_engine.config import SpeculationConfig
from llm_engine.proposers.base import EMPTY_DRAFT, Draft, ProposeContext, Proposer, register


@register("ngram")
class NgramProposer(Proposer):
    def __init__(self, ngram_min: int = 1, ngram_max: int = 3):
        assert 1 <= ngram_min <= ngram_max
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._tokens: list[int] = []
        # _index[n][ngram] = end of that n-gram's most recent occurrence which has a next token.
        self._index: dict[int, dict[tuple[int, ...], int]] = {}

    @classmethod
    def create(cls, spec: SpeculationConfig, draft_model=None) -> NgramProposer:
        return cls(spec.ngram_min, spec.ngram_max)

    def begin(self, prompt_ids: list[int]) -> None:
        self._tokens = []
        self._index = {n: {} for n in range(self.ngram_min, self.ngram_max + 1)}
        self._extend(prompt_ids)

    def propose(self, ctx: ProposeContext) -> Draft:
        # Committed tokens only ever grow within a request, so catching up is incremental.
        self._extend(ctx.token_ids[len(self._tokens) :])
        tokens = self._tokens
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            end = self._index[n].get(tuple(tokens[-n:]))
            if end is not None:
                return Draft(tokens[end : end + ctx.k])
        return EMPTY_DRAFT

    def release(self) -> None:
        self._tokens = []
        self._index = {}

    def _extend(self, new_tokens: list[int]) -> None:
        tokens = self._tokens
        for token in new_tokens:
            tokens.append(token)
            # Index the n-grams ending just before this token: they now have a continuation.
            end = len(tokens) - 1
            for n, index in self._index.items():
                if end >= n:
                    index[tuple(tokens[end - n : end])] = end
