"""`draft`: an independent causal LM proposes k tokens, one cached forward each.

Any Hugging Face causal LM that shares the target's vocabulary can draft, including the target
itself (then every draft is accepted). It runs through a target runner's interface: the HF model
eagerly, or a runner given instead of the model (the lean runner, `llm_engine.lean`, puts a
Llama-family draft on the same cheap path as the target). The proposer owns the draft's KV cache
and keeps the same invariant as the engine's target cache (`llm_engine.kv`): it only holds
committed tokens, and tokens it has not seen yet (the recovered or bonus token, gated plain steps)
are fed at the start of the next proposal.
"""

from __future__ import annotations

import torch

from llm_engine import kv
from llm_engine.config import SpeculationConfig
from llm_engine.proposers.base import Draft, ProposeContext, Proposer, register
from llm_engine.runner import EagerRunner, TargetRunner


@register("draft")
class DraftModelProposer(Proposer):
    model_setting = "draft"
    samples_drafts = True

    def __init__(self, model: torch.nn.Module | TargetRunner):
        self.runner = model if isinstance(model, TargetRunner) else EagerRunner(model)
        self.device = self.runner.device
        # Made at the first proposal, on the engine's thread: a request starts on its caller's
        # (an event loop), and torch work there starts a second OpenMP team that slows every
        # step after it (measured: a q4 step 15 -> 30 ms).
        self.cache = None
        self._cached: list[int] = []  # the tokens whose positions are in self.cache
        self._last_k = 0

    @classmethod
    def create(cls, spec: SpeculationConfig,
               draft_model: torch.nn.Module | TargetRunner | None = None):
        if draft_model is None:
            raise ValueError("speculation method 'draft' needs a draft model")
        return cls(draft_model)

    def begin(self, prompt_ids: list[int]) -> None:
        # A cache kept from an earlier turn stays valid up to the first differing token.
        keep = kv.common_prefix_len(self._cached, prompt_ids)
        self._rollback(keep)

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> Draft:
        assert len(self._cached) < len(ctx.token_ids)
        if ctx.k <= 0:
            return Draft([])
        if self.cache is None:
            self.cache = self.runner.new_cache()
        pending = ctx.token_ids[len(self._cached) :]
        next_input = torch.tensor([pending], device=self.device)  # [1, n_pending]
        builder = ctx.draft_builder()
        for i in range(ctx.k):
            logits = self.runner.forward(self.cache, next_input, last_only=True).logits  # [1, V]
            token = builder.choose(logits)  # [1]
            if i + 1 < ctx.k:
                next_input = token.view(1, 1)  # stays on the device: one host sync per proposal
        draft = builder.build()
        self._cached.extend(pending)
        self._cached.extend(draft.tokens[:-1])  # the last draft token was never fed
        self._last_k = ctx.k
        return draft

    def update(self, num_accepted: int) -> None:
        # The cache holds the context plus drafts d_0..d_{k-2}; only accepted ones stay valid.
        rejected_in_cache = (self._last_k - 1) - min(num_accepted, self._last_k - 1)
        self._rollback(len(self._cached) - rejected_in_cache)

    def release(self) -> None:
        self.cache = None
        self._cached = []

    def _rollback(self, length: int) -> None:
        del self._cached[length:]
        if self.cache is not None:
            self.runner.crop(self.cache, length)
            assert self.runner.length(self.cache) == len(self._cached)
