"""Shared prompt prefixes (`llm_engine.prefixes`): a new session whose prompt starts with a kept
prefix (a system prompt) prefills only the rest, and answers as if it had prefilled it all."""

from __future__ import annotations

import random

import torch

from llm_engine.config import SamplingConfig
from llm_engine.lean.runner import LeanRunner
from llm_engine.prefixes import MIN_TOKENS, SharedPrefixes
from tests.llm_engine.requests import run
from tests.llm_engine.test_engine import make_engine

SYSTEM = [random.Random(1).randrange(3, 200) for _ in range(MIN_TOKENS + 8)]


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return SYSTEM + [rng.randrange(3, 200) for _ in range(6)]


def test_a_new_session_starts_from_a_kept_prefix_and_answers_as_if_it_prefilled_it(
        target, tokenizer):
    engine = make_engine(target, tokenizer)
    engine.keep_prefix(SYSTEM)  # at load
    tokens, state = run(engine, _prompt(2), session_id="second call")
    assert state.stats.reused_prefix_tokens == len(SYSTEM)
    assert state.stats.prefill_tokens == len(_prompt(2)) - len(SYSTEM)
    alone, _ = run(make_engine(target, tokenizer), _prompt(2))
    assert tokens == alone


def test_a_prompt_sharing_too_little_prefills_everything(target, tokenizer):
    engine = make_engine(target, tokenizer)
    engine.keep_prefix(SYSTEM)
    other = SYSTEM[:MIN_TOKENS - 1] + [7] * 20
    _, state = run(engine, other)
    assert state.stats.reused_prefix_tokens == 0


def test_a_request_prefilled_from_scratch_is_not_kept(target, tokenizer):
    engine = make_engine(target, tokenizer)
    run(engine, _prompt(1))
    _, state = run(engine, _prompt(2))
    assert state.stats.reused_prefix_tokens == 0 and len(engine.prefixes) == 0


def test_only_the_most_recently_used_prefixes_are_kept(target, tokenizer):
    engine = make_engine(target, tokenizer)
    engine.prefixes.capacity = 2
    families = [[k + 3] * (MIN_TOKENS + 4) for k in range(3)]
    for family in families:
        engine.keep_prefix(family)
    assert len(engine.prefixes) == 2
    _, state = run(engine, families[0] + [9], SamplingConfig(max_new_tokens=1))
    assert state.stats.reused_prefix_tokens == 0  # the oldest was dropped


def test_the_lean_runner_copies_a_prefix_into_a_full_size_cache(target):
    runner = LeanRunner(target, "bfloat16", max_cache_len=256, max_rows=4)
    ids = torch.tensor([_prompt(3)])
    with torch.inference_mode():
        cache = runner.new_cache()
        runner.forward(cache, ids)
        prefixes = SharedPrefixes(runner)
        prefixes.keep(_prompt(3), cache)
        copy, length = prefixes.start(SYSTEM + [201, 202])  # 201: no prompt token above 200
    assert length == len(SYSTEM) and copy.length == length
    assert copy.k.shape == cache.k.shape  # room for the rest of the conversation
    assert torch.equal(copy.k[:, :, :length], cache.k[:, :, :length])
    assert torch.equal(copy.v[:, :, :length], cache.v[:, :, :length])
