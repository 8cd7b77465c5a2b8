"""`eagle`: a draft head over the target's own last hidden states (`llm_engine.eagle_head`).

The engine hands the proposer the target's feature of every committed position after each
target forward (`observe_target`), so the features cover exactly the positions of the target's
KV cache: all committed tokens but the last. A proposal first runs the head over the positions
it has not seen (their true features), then drafts k tokens feeding its own predicted features
back in, and finally drops those speculative positions from its cache: after verification the
accepted ones come back with the target's true features.
"""

from __future__ import annotations

import torch

from llm_engine import kv
from llm_engine.config import SpeculationConfig
from llm_engine.eagle_head import EagleHead
from llm_engine.proposers.base import Draft, DraftBuilder, ProposeContext, register


@register("eagle")
class EagleProposer:
    samples_drafts = True
    uses_target_hidden = True

    def __init__(self, head: EagleHead):
        self.head = head
        self.device = next(head.parameters()).device
        self.release()

    @classmethod
    def create(cls, spec: SpeculationConfig, model: torch.nn.Module | None = None):
        if not isinstance(model, EagleHead):
            raise ValueError("speculation method 'eagle' needs an EAGLE head (engine.eagle)")
        return cls(model)

    def begin(self, prompt_ids: list[int]) -> None:
        # Feature i depends on tokens 0..i; the head's cache entry i also on token i + 1.
        keep = kv.common_prefix_len(self._tokens, prompt_ids)
        self._features = self._features[:keep]
        self._tokens = self._tokens[:keep]
        self._crop(min(self._fed, max(keep - 1, 0)))

    def observe_target(self, token_ids: list[int], hidden: torch.Tensor) -> None:
        """hidden [r, hidden]: the target's features of the r positions before the last token."""
        start = len(token_ids) - 1 - hidden.shape[0]
        assert 0 <= start <= len(self._features), "a gap in the target's features"
        self._features = torch.cat([self._features[:start], hidden.to(self._features.dtype)])
        self._tokens = list(token_ids[:-1])
        self._crop(min(self._fed, start))

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> Draft:
        n = len(ctx.token_ids)
        assert len(self._features) == n - 1, "features must cover all committed tokens but the last"
        if ctx.k <= 0 or n < 2:
            return Draft([])
        self._crop(min(self._fed, n - 2))  # at least one position to feed: its output drafts d_0
        start = self._fed
        features = self._features[start:].unsqueeze(0)  # [1, m, hidden]
        tokens = torch.tensor([ctx.token_ids[start + 1 :]], device=self.device)  # [1, m]
        predicted = self.head(features, tokens, self.cache)[:, -1:]  # [1, 1, hidden]
        self._fed = n - 1
        builder = DraftBuilder(ctx.sampling, ctx.generator)
        for i in range(ctx.k):
            token = builder.choose(self.head.logits(predicted[0]))  # [1]
            if i + 1 < ctx.k:
                predicted = self.head(predicted, token.view(1, 1), self.cache)  # [1, 1, hidden]
        self._crop(self._fed)  # speculative positions: the target's features replace them
        return builder.build()

    def update(self, num_accepted: int) -> None:
        pass  # the accepted positions' true features arrive through observe_target

    def release(self) -> None:
        self.cache = kv.new_cache(self.head)
        self._features = torch.empty(0, self.head.config.hidden_size, device=self.device,
                                     dtype=next(self.head.parameters()).dtype)
        self._tokens: list[int] = []
        self._fed = 0  # positions whose head KV (from true features) is in self.cache

    def _crop(self, length: int) -> None:
        kv.crop_to(self.cache, length)
        self._fed = length
