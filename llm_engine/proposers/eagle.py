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
from llm_engine.lean.eagle import LeanEagleHead
from llm_engine.proposers.base import Draft, ProposeContext, Proposer, register


@register("eagle")
class EagleProposer(Proposer):
    model_setting = "eagle"
    samples_drafts = True
    uses_target_hidden = True

    def __init__(self, head: EagleHead | LeanEagleHead):
        self.head = head
        self.device = head.device
        self.release()

    @classmethod
    def create(cls, spec: SpeculationConfig, model: torch.nn.Module | None = None):
        if not isinstance(model, EagleHead | LeanEagleHead):
            raise ValueError("speculation method 'eagle' needs an EAGLE head (engine.eagle)")
        return cls(model)

    @property
    def _features(self) -> torch.Tensor:
        return self._buffer[: self._count]  # [positions, hidden]

    def begin(self, prompt_ids: list[int]) -> None:
        # Feature i depends on tokens 0..i; the head's cache entry i also on token i + 1.
        keep = kv.common_prefix_len(self._tokens, prompt_ids)
        self._count = min(self._count, keep)
        self._tokens = self._tokens[:keep]
        self._crop(min(self._fed, max(keep - 1, 0)))

    def observe_target(self, token_ids: list[int], hidden: torch.Tensor) -> None:
        """hidden [r, hidden]: the target's features of the r positions before the last token.

        Stored in a buffer that doubles when full: a plain step (and every step of a closed gate)
        costs one row's copy, and the head catches up on them only when it drafts again.
        """
        start = len(token_ids) - 1 - hidden.shape[0]
        assert 0 <= start <= self._count, "a gap in the target's features"
        end = start + hidden.shape[0]
        if end > len(self._buffer):
            grown = self._buffer.new_empty(max(end, 2 * len(self._buffer)), self._buffer.shape[1])
            grown[:start] = self._buffer[:start]
            self._buffer = grown
        self._buffer[start:end] = hidden
        self._count = end
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
        builder = ctx.draft_builder()
        for i in range(ctx.k):
            token = builder.choose(self.head.logits(predicted[0]))  # [1]
            if i + 1 < ctx.k:
                predicted = self.head(predicted, token.view(1, 1), self.cache)  # [1, 1, hidden]
        self._crop(self._fed)  # speculative positions: the target's features replace them
        return builder.build()

    def release(self) -> None:
        self.cache = self.head.new_cache()
        self._buffer = torch.empty(256, self.head.config.hidden_size, device=self.device,
                                   dtype=self.head.dtype)
        self._count = 0  # positions whose target features are in the buffer
        self._tokens: list[int] = []
        self._fed = 0  # positions whose head KV (from true features) is in self.cache

    def _crop(self, length: int) -> None:
        self.head.crop(self.cache, length)
        self._fed = length
