"""KV cache rollback and prefix reuse helpers, and the engine's cache invariant."""

from __future__ import annotations

import torch

from llm_engine import kv
from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine

TOKENS = [5, 17, 42, 9, 3, 77, 12, 8]


def prefilled(model, tokens: list[int]):
    cache = kv.new_cache(model)
    with torch.inference_mode():
        kv.forward(model, torch.tensor([tokens]), cache)
    return cache


def test_crop_to_drops_the_tail(target):
    cache = prefilled(target, TOKENS)
    kv.crop_to(cache, 5)
    assert kv.cache_length(cache) == 5


def test_crop_to_a_longer_length_is_a_no_op(target):
    cache = prefilled(target, TOKENS)
    kv.crop_to(cache, len(TOKENS))
    kv.crop_to(cache, 100)
    assert kv.cache_length(cache) == len(TOKENS)


def test_cropped_cache_continues_exactly_like_a_fresh_prefill(target):
    cache = prefilled(target, TOKENS)
    kv.crop_to(cache, 4)
    fresh = prefilled(target, TOKENS[:4])
    with torch.inference_mode():
        after_crop = kv.forward(target, torch.tensor([[99, 98]]), cache)
        reference = kv.forward(target, torch.tensor([[99, 98]]), fresh)
    assert torch.allclose(after_crop, reference, atol=1e-5)


def test_forward_last_only_returns_the_last_row(target):
    with torch.inference_mode():
        every = kv.forward(target, torch.tensor([TOKENS]), kv.new_cache(target))
        last = kv.forward(target, torch.tensor([TOKENS]), kv.new_cache(target), last_only=True)
    assert every.shape == (len(TOKENS), target.config.vocab_size)
    assert last.shape == (1, target.config.vocab_size)
    assert torch.allclose(last, every[-1:], atol=1e-5)


def test_common_prefix_len():
    assert kv.common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert kv.common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert kv.common_prefix_len([], [1]) == 0


def test_no_stale_position_after_rejections(target, draft, tokenizer):
    # Invariant: after every step the target cache holds all committed tokens but the last.
    config = EngineConfig(
        speculation=SpeculationConfig(method="draft", adaptive=False, gate=False),
        sampling=SamplingConfig(max_new_tokens=30),
    )
    engine = SpeculativeEngine(target, tokenizer, config, draft_model=draft)
    state = engine.start([5, 17, 42, 9, 3], session_id=None)
    while not state.finished:
        engine.step(state)
        assert kv.cache_length(state.cache) == len(state.token_ids) - 1
        draft_cache = state.proposer.cache  # None once the finished request freed it
        assert draft_cache is None or kv.cache_length(draft_cache) <= len(state.token_ids) - 1
    assert any(step.rejection_pos is not None for step in state.stats.steps)
    engine.release(state)
