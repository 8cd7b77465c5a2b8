"""Seeded sampled requests on tiny models: the tokens depend on the seed, never on K or the gate.

Drafts without q (n-gram) and plain steps are verified with per-position Gumbel noise
(`llm_engine.verify`), so a seeded `ngram` request gives `off`'s tokens whatever the draft-length
schedule, and the cost gate can stay on for it.
"""

from __future__ import annotations

import random

import pytest

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine
from tests.llm_engine.requests import run

NEW_TOKENS = 32
# Repetitive prompts, so that prompt lookup finds matches and some drafts are accepted.
PROMPTS = [[5, 17, 42, 9] * 3, [30, 31, 32, 33, 34, 30, 31, 32], [7, 8, 7, 8, 7, 8, 60]]
SEEDS = [0, 1, 123]


def sampling(seed: int | None) -> SamplingConfig:
    return SamplingConfig(temperature=0.9, top_p=0.95, seed=seed, max_new_tokens=NEW_TOKENS)


def make_engine(target, tokenizer, method: str, draft=None, **spec) -> SpeculativeEngine:
    config = EngineConfig(speculation=SpeculationConfig(method=method, **spec))
    return SpeculativeEngine(target, tokenizer, config, draft_model=draft)


@pytest.fixture(scope="module")
def off_tokens(target, tokenizer):
    engine = make_engine(target, tokenizer, "off")
    return {(i, s): run(engine, p, sampling(s))[0] for i, p in enumerate(PROMPTS) for s in SEEDS}


def test_seeded_ngram_with_the_gate_closed_equals_off(target, tokenizer, off_tokens):
    engine = make_engine(target, tokenizer, "ngram")
    for (i, seed), expected in off_tokens.items():
        tokens, state = run(engine, PROMPTS[i], sampling(seed), limit=lambda k: 0)
        assert tokens == expected
        assert state.stats.drafted == 0


@pytest.mark.parametrize("k", [1, 4, 10])
def test_seeded_ngram_with_the_gate_open_equals_off_for_any_fixed_k(
    target, tokenizer, off_tokens, k
):
    engine = make_engine(
        target,
        tokenizer,
        "ngram",
        num_draft_tokens=k,
        max_draft_tokens=k,
        adaptive=False,
        gate=False,
    )
    for (i, seed), expected in off_tokens.items():
        assert run(engine, PROMPTS[i], sampling(seed))[0] == expected
    assert engine.totals.accepted > 0  # the equality is not just "nothing was ever drafted"
    assert engine.totals.accepted < engine.totals.drafted  # and rejections happened too


def test_seeded_ngram_with_a_random_gate_schedule_equals_off(target, tokenizer, off_tokens):
    rng = random.Random(0)
    engine = make_engine(target, tokenizer, "ngram")
    for (i, seed), expected in off_tokens.items():
        tokens, _ = run(engine, PROMPTS[i], sampling(seed), limit=lambda k: rng.randint(0, 10))
        assert tokens == expected


def test_seeded_ngram_keeps_the_gate_on_and_reproduces(target, tokenizer, off_tokens):
    engine = make_engine(target, tokenizer, "ngram")  # defaults: adaptive K and the timed gate
    for (i, seed), expected in off_tokens.items():
        first, state = run(engine, PROMPTS[i], sampling(seed))
        second, _ = run(engine, PROMPTS[i], sampling(seed))
        assert state.gate.enabled
        assert first == second == expected


def test_seeded_draft_model_gates_on_the_cost_model_only_and_reproduces(
        target, draft, tokenizer):
    # Rejection sampling on the request generator: its draws follow the K schedule, which
    # therefore must not depend on timings, only on the engine's (loaded) cost model.
    engine = make_engine(target, tokenizer, "draft", draft)
    first, state = run(engine, PROMPTS[0], sampling(7))
    again = make_engine(target, tokenizer, "draft", draft)
    again.cost_model = engine.cost_model  # the same machine and cache
    second, _ = run(again, PROMPTS[0], sampling(7))
    assert state.gate.enabled and not state.gate.measured
    assert first == second


def test_unseeded_draft_model_keeps_the_gate(target, draft, tokenizer):
    engine = make_engine(target, tokenizer, "draft", draft)
    _, state = run(engine, PROMPTS[0], sampling(None))
    assert state.gate.enabled


def test_unseeded_requests_draw_their_own_noise(target, tokenizer):
    engine = make_engine(target, tokenizer, "ngram")
    outputs = {tuple(run(engine, PROMPTS[0], sampling(None))[0]) for _ in range(4)}
    assert len(outputs) > 1
