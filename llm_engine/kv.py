"""KV caches: a cached forward pass, rollback after a rejection, and prefix reuse.

Invariant kept by the engine for the target cache (and by the draft proposer for its own): the
cache holds exactly the positions of a prefix of the committed tokens, never a rejected draft
token. For the target that prefix is all committed tokens but the last one, which is fed as the
first input of the next step (gpt-fast and HF assisted generation use the same convention).

transformers 5.24 `DynamicCache.crop(n)`: a negative n removes |n| tokens; a positive n raises
(in 4.x it meant "keep n"). 4.x already read a negative n as "remove |n|", so `crop_to` only ever
passes a negative count and works on every version the project allows.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
from transformers import DynamicCache


def new_cache(model: torch.nn.Module) -> DynamicCache:
    # The config lets transformers pick sliding-window layers where the model has them.
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop_to(cache: DynamicCache, length: int) -> None:
    """Drop every cached position at index >= length."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@cache
def _forward_kwargs(model_class: type) -> tuple[str, bool]:
    # transformers 5.x renamed `past_key_values` to `cache`; accept either so any HF causal LM
    # in the allowed version range can serve as target or draft.
    params = inspect.signature(model_class.forward).parameters
    cache_name = "cache" if "cache" in params else "past_key_values"
    return cache_name, "logits_to_keep" in params


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which the model's forward takes its KV cache."""
    return _forward_kwargs(type(model))[0]


def forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    last_only: bool = False,
    hidden: bool = False,
):
    """Run new tokens through the model on top of the cache, which grows by n.

    input_ids: [1, n] -> logits [n, vocab] (or [1, vocab] with last_only, which skips the output
    head for all but the last position: most of a prefill's head cost). With `hidden`, also the
    last hidden states [n, hidden_size] (what the output head reads), as (logits, hidden).
    """
    assert input_ids.ndim == 2 and input_ids.shape[0] == 1
    if plain_head(model):
        # The decoder's output is what the head reads, so the hidden states cost nothing.
        decoder = model.get_decoder()
        states = decoder(
            input_ids=input_ids, use_cache=True, **{cache_argument(decoder): cache}
        ).last_hidden_state[0]  # [n, hidden]
        logits = model.get_output_embeddings()(states[-1:] if last_only else states)
        return (logits, states) if hidden else logits
    cache_name, has_keep = _forward_kwargs(type(model))
    kwargs = {cache_name: cache, "use_cache": True}
    if last_only and has_keep:
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=input_ids, output_hidden_states=hidden, **kwargs)
    logits = out.logits[0]  # [n or 1, vocab]
    logits = logits[-1:] if last_only else logits
    return (logits, out.hidden_states[-1][0]) if hidden else logits


# Config fields of models whose forward transforms the head's output (Gemma 2's soft-capping,
# Cohere's and Granite's scaling): those run through their own forward.
_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def plain_head(model: torch.nn.Module) -> bool:
    """Whether the logits are the output head applied to the decoder's last hidden states, so a
    runner may call the decoder and the head itself."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_decoder"):
        return False
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _HEAD_TRANSFORMS):
        return False
    return model.get_output_embeddings() is not None
