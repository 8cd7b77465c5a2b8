"""An EAGLE head (`llm_engine.eagle_head`) on the lean forward, in the target runner's format.

The head is one of the target's decoder layers plus an input projection and a reduced-vocabulary
head; through HF's eager layer each drafted token costs several times what the layer's arithmetic
does. Here its layer runs through `LeanLlama.run` (fused projections, the lean KV cache), its input
projection in the same weight format, and its reduced head as it is. Its drafts may differ from
the HF head's by rounding: the target's verification keeps the output exact whatever is drafted.
"""

from __future__ import annotations

import torch
from torch import nn

from llm_engine.eagle_head import EagleHead
from llm_engine.lean.llama import LeanCache, LeanLlama


class LeanEagleHead(nn.Module):
    """What `EagleProposer` calls, as `EagleHead` offers it: forward, logits, new_cache, crop."""

    def __init__(self, head: EagleHead, fmt: str, max_cache_len: int,
                 attention_dtype: torch.dtype | None = None):
        super().__init__()
        self.config = head.config
        self.stack = LeanLlama(head.layer, fmt, attention_dtype=attention_dtype)
        self.device, self.dtype = self.stack.device, self.stack.dtype
        self.fc = self.stack.linear(head.fc)
        self.embed = head._embed[0].weight.detach().to(self.dtype)
        self.head = head.head  # [vocab_ids, hidden], run in its own dtype
        self.head_dtype = next(head.head.parameters()).dtype
        self.max_cache_len = max_cache_len

    def forward(self, features: torch.Tensor, tokens: torch.Tensor,
                cache: LeanCache) -> torch.Tensor:
        """features [1, n, hidden] (f_i), tokens [1, n] (t_{i+1}) -> f_{i+1} [1, n, hidden]."""
        x = self.fc(torch.cat([self.embed[tokens[0]], features[0].to(self.dtype)], dim=-1))
        out = self.stack.run(x, cache, cache.length)
        cache.length += x.shape[0]
        return out[None]

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        return self.head(predicted.to(self.head_dtype))

    def new_cache(self) -> LeanCache:
        return self.stack.new_cache(self.max_cache_len)

    @staticmethod
    def length(cache: LeanCache) -> int:
        return cache.length

    @staticmethod
    def crop(cache: LeanCache, length: int) -> None:
        cache.length = min(cache.length, length)

