"""The compiled target runner, in the gpt-fast style: fixed shapes over a static KV cache.

Decode and verify forwards run `torch.compile`d graphs, one per row bucket (1, 4, 8, ... rows):
a forward of n rows is padded up to its bucket, whose extra rows write KV past the real ones that
the engine crops with the rejected drafts (rows only attend backwards, so padding never changes a
real row). On CUDA the graphs are captured as CUDA graphs (`mode="reduce-overhead"`), which
removes the per-kernel launch cost that dominates a small model's step. Prefill chunks longer
than the largest bucket run eagerly on the same cache.

The cache is transformers' `StaticCache`: its length is a counter, so a crop is free, and its
tensors have fixed addresses, which CUDA graphs need. Each graph attends over the whole
`max_cache_len`, so on a CPU every step pays for the full context: `engine.runner: auto` keeps
this runner only where it measures faster.
"""

from __future__ import annotations

import torch
from transformers import StaticCache

from llm_engine import kv
from llm_engine.runner import Forward, TargetRunner

BUCKETS = (1, 4, 8, 12, 16)


def supports(model: torch.nn.Module) -> str | None:
    """Why the compiled runner cannot serve `model`, or None when it can."""
    if not kv.plain_head(model):
        return (f"{type(model).__name__}: the compiled runner needs a decoder and a plain "
                "output head")
    for layer in StaticCache(config=model.config, max_cache_len=1).layers:
        if not (_crops(layer) or (hasattr(layer, "cumulative_length")
                                  and not getattr(layer, "is_sliding", False))):
            return (f"this transformers' {type(layer).__name__} cannot be cropped (no crop, "
                    "or a sliding window without one)")
    return None


def _crops(layer) -> bool:
    return callable(getattr(layer, "crop", None))


class CompiledRunner(TargetRunner):
    name = "compiled"

    def __init__(self, model: torch.nn.Module, max_cache_len: int,
                 buckets: tuple[int, ...] = BUCKETS):
        super().__init__(model)
        reason = supports(model)
        if reason:
            raise ValueError(f"{reason}; use engine.runner: eager")
        self.max_cache_len = max_cache_len
        self.buckets = tuple(sorted(buckets))
        self._decoder = model.get_decoder()
        self._cache_arg = kv.cache_argument(self._decoder)
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        self._compiled = torch.compile(self._run, mode=mode, fullgraph=False, dynamic=False)

    def new_cache(self) -> StaticCache:
        return StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)

    def length(self, cache: StaticCache) -> int:
        return int(cache.get_seq_length())

    def crop(self, cache: StaticCache, length: int) -> None:
        extra = self.length(cache) - length
        if extra <= 0:
            return
        for layer in cache.layers:
            if _crops(layer):  # each layer kind keeps its own counters
                layer.crop(-extra)
            else:  # transformers 5.17's StaticLayer: the counter, no crop (supports() checked)
                layer.cumulative_length.sub_(extra)

    @torch.inference_mode()
    def forward(self, cache: StaticCache, input_ids: torch.Tensor,
                last_only: bool = False) -> Forward:
        n = input_ids.shape[1]
        start = self.length(cache)
        if start + n > self.max_cache_len:
            raise ValueError(
                f"{start + n} positions exceed the static cache ({self.max_cache_len})")
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None or start + bucket > self.max_cache_len:
            hidden = self._run(input_ids, cache)  # a long prefill chunk: eager
        else:
            # A fresh tensor made here, in inference mode, whatever the caller's was: a graph
            # is guarded on its inputs' dispatch keys and would recompile for each kind.
            padded = torch.cat([input_ids, input_ids[:, -1:].expand(1, bucket - n)], dim=1)
            hidden = self._compiled(padded, cache)[:n]
            if self.device.type == "cuda":
                hidden = hidden.clone()  # the graph's output buffer is reused by the next replay
        rows = hidden[-1:] if last_only else hidden
        logits = self.model.get_output_embeddings()(rows).float()
        return Forward(logits, hidden)

    def _run(self, input_ids: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        # Positions come from the cache's length counter, a tensor: one graph serves them all.
        out = self._decoder(input_ids=input_ids, use_cache=True, **{self._cache_arg: cache})
        return out.last_hidden_state[0]  # [rows, hidden]
