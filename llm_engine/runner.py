"""Target runners: the engine's only way to the target model.

A runner runs new rows against a KV cache, crops the cache back to the committed tokens, and says
how long it is. It always hands back the last hidden states with the logits: the decoder computes
them anyway for the output head, so a proposer that reads them (EAGLE) costs the target nothing.
Logits come back in float32 whatever the weights' format: argmax ties and the verification's
arithmetic must not depend on bf16 rounding of the scores.

- `EagerRunner`: the model's own forward over a `DynamicCache` (any Hugging Face causal LM).
- `CompiledRunner` (`llm_engine.compiled_runner`): fixed shapes over a static cache, compiled.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from llm_engine import kv


@dataclass
class Forward:
    logits: torch.Tensor  # [n, vocab] float32, or [1, vocab] for last_only
    hidden: torch.Tensor  # [n, hidden_size] in the model's dtype: what the output head read


class TargetRunner:
    """The interface; `EagerRunner` is the reference implementation."""

    name = "base"

    def __init__(self, model: torch.nn.Module):
        self.model = model
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype

    @property
    def format(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def new_cache(self):
        raise NotImplementedError

    def length(self, cache) -> int:
        raise NotImplementedError

    def crop(self, cache, length: int) -> None:
        """Drop every cached position at index >= length."""
        raise NotImplementedError

    def forward(self, cache, input_ids: torch.Tensor, last_only: bool = False) -> Forward:
        """input_ids [1, n] on top of the cache, which grows by n."""
        raise NotImplementedError

    # Rows one shared forward may carry (`forward_many`); 0: this runner runs them one by one.
    shared_rows = 0
    copies_prefixes = False  # `copy_prefix` works: new sessions may start from a kept prefix

    def copy_prefix(self, cache, length: int, compact: bool = False):
        """A new cache holding a copy of the first `length` positions of `cache`; `compact`:
        it may be sized for those alone (kept, never run on; a growing cache ignores it)."""
        raise NotImplementedError

    def forward_many(self, steps: list[tuple[object, torch.Tensor]]) -> list[Forward]:
        """Several requests' rows [(cache, input_ids [1, n])], each on its own cache: the same
        as `forward` on each, in one pass where the runner can (`shared_rows`)."""
        return [self.forward(cache, ids) for cache, ids in steps]


class EagerRunner(TargetRunner):
    name = "eager"
    copies_prefixes = True

    def copy_prefix(self, cache: DynamicCache, length: int, compact: bool = False) -> DynamicCache:
        copy = deepcopy(cache)
        kv.crop_to(copy, length)
        return copy

    def new_cache(self) -> DynamicCache:
        return kv.new_cache(self.model)

    def length(self, cache: DynamicCache) -> int:
        return kv.cache_length(cache)

    def crop(self, cache: DynamicCache, length: int) -> None:
        kv.crop_to(cache, length)

    def forward(self, cache: DynamicCache, input_ids: torch.Tensor,
                last_only: bool = False) -> Forward:
        logits, hidden = kv.forward(self.model, input_ids, cache, last_only, hidden=True)
        return Forward(logits.float(), hidden)
