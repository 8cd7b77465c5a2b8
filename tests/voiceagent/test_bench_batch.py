"""`voiceagent bench engine --batch`: sessions decoding at once, on a tiny random Llama through
the lean runner (no model loading)."""

from __future__ import annotations

import pytest

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine
from llm_engine.lean.runner import LeanRunner
from tests.llm_engine.test_engine import random_prompts
from voiceagent.bench.batch import (
    aggregate_tok_s,
    batch_sampling,
    decode_together,
    paired_ratios,
    render,
    run_batch,
)


@pytest.fixture(scope="module")
def engine(tokenizer, model):
    runner = LeanRunner(model, "q4", max_cache_len=256, max_rows=6, cache_slots=4)
    if not runner.shared_rows:
        pytest.skip("this CPU's q4 kernels need whole forwards padded: nothing is shared")
    config = EngineConfig(sampling=SamplingConfig(max_new_tokens=12), max_context=256,
                          speculation=SpeculationConfig(method="off", max_draft_tokens=5))
    return SpeculativeEngine(model, tokenizer, config, runner=runner)


def test_the_aggregate_rate_is_every_sessions_decoded_tokens_over_the_shared_time(engine):
    prompts = random_prompts(engine.runner.lean.vocab, 3, seed=4)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=12)
    got = decode_together(engine, prompts, sampling, "off", shared=True)
    decoded = sum(len(out) - 1 for out in got["outputs"])  # each session's first came at prefill
    seconds = decoded / got["aggregate_tok_s"]
    assert 0 < seconds < 60
    assert aggregate_tok_s(decoded, seconds) == pytest.approx(got["aggregate_tok_s"])
    assert aggregate_tok_s(5, 0.0) == 0.0


def test_the_all_live_rate_counts_only_the_rounds_every_session_decoded_in(engine):
    prompts = random_prompts(engine.runner.lean.vocab, 3, seed=5)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=12)
    got = decode_together(engine, prompts, sampling, "off", shared=True)
    decoded = [len(out) - 1 for out in got["outputs"]]
    # without speculation a round gives each live session one token: every session was live
    # for as many rounds as the shortest reply took
    assert got["all_live_tokens"] == len(prompts) * min(decoded)
    assert got["all_live_tok_s"] > 0


def test_the_batch_table_runs_each_mode_and_count_and_says_the_outputs_are_identical(engine):
    prompts = random_prompts(engine.runner.lean.vocab, 4, seed=6)
    rows = run_batch(engine, prompts, [1, 2], ["off", "ngram"], 10, say=lambda _: None)
    assert [(r["mode"], r["sessions"]) for r in rows] == \
        [("off", 1), ("off", 2), ("ngram", 1), ("ngram", 2)]
    assert all(r["identical"] for r in rows)
    if engine.runner.lean.batch_attention:  # the pool's product beside each attending alone
        assert [r["attend_alone_tok_s"] is not None for r in rows] == [False, True] * 2
    assert all(r["shared_vs_one_session"] == pytest.approx(
        r["shared_tok_s"] / next(o["shared_tok_s"] for o in rows
                                 if o["mode"] == r["mode"] and o["sessions"] == 1))
               for r in rows)
    table = render(rows, ["# header"])
    assert "| off | 2 |" in table and "**no**" not in table
    assert all(r["all_live_vs_one_session"] > 0 for r in rows)


def test_every_session_decodes_all_its_tokens_unless_told_to_stop_at_eos(engine):
    prompts = random_prompts(engine.runner.lean.vocab, 2, seed=8)
    plain = decode_together(engine, prompts, batch_sampling(10), "off", shared=True)["outputs"]
    # an EOS that session 0 reaches before its last token, neither session at prefill
    token = next(t for t in plain[0][1:9] if t not in (plain[0][0], plain[1][0]))
    rounds = min(out.index(token) if token in out else len(out) for out in plain)
    eos, engine.eos_token_ids = engine.eos_token_ids, frozenset({token})
    try:
        past = decode_together(engine, prompts, batch_sampling(10), "off", shared=True)
        stopped = decode_together(engine, prompts, batch_sampling(10, stop_at_eos=True), "off",
                                  shared=True)
    finally:
        engine.eos_token_ids = eos
    # past the EOS: 9 rounds of both sessions; stopped there: only the rounds before it
    assert past["outputs"] == plain and past["all_live_tokens"] == 2 * 9
    assert rounds < 9 and stopped["all_live_tokens"] == 2 * rounds


def test_repeats_take_the_median_of_each_ways_runs(engine):
    prompts = random_prompts(engine.runner.lean.vocab, 2, seed=7)
    [row] = run_batch(engine, prompts, [2], ["off"], 8, say=lambda _: None, repeats=3)
    assert row["repeats"] == 3 and row["identical"]
    assert row["shared_tok_s"] > 0 and row["one_by_one_tok_s"] > 0


def test_each_repeats_ratio_pairs_it_with_the_one_session_run_of_the_same_repeat(engine):
    prompts = random_prompts(engine.runner.lean.vocab, 2, seed=10)
    one, two = run_batch(engine, prompts, [1, 2], ["off"], 6, say=lambda _: None, repeats=3)
    assert len(two["all_live_runs_tok_s"]) == 3
    assert two["all_live_vs_one_session_runs"] == pytest.approx(
        [a / b for a, b in zip(two["all_live_runs_tok_s"], one["all_live_runs_tok_s"],
                               strict=True)])
    assert one["all_live_vs_one_session_runs"] == pytest.approx([1.0] * 3)
    runs = two["all_live_vs_one_session_runs"]
    table = render([one, two], ["# header"])
    assert f"({min(runs):.2f}–{max(runs):.2f})" in table and "(1.00–1.00)" not in table


def test_paired_ratios_skip_a_repeat_without_both_rates():
    assert paired_ratios([4.0, None, 9.0], [2.0, 3.0, None]) == [2.0]


def test_each_repeat_runs_every_session_count_in_turn(engine):
    """A ratio's two sides are measured next to each other, not a sweep apart."""
    prompts = random_prompts(engine.runner.lean.vocab, 2, seed=9)
    said: list[str] = []
    run_batch(engine, prompts, [1, 2], ["off"], 4, say=said.append, repeats=2)
    assert said == [f"batch: off, {n} session(s), run {r} of 2" for r in (1, 2) for n in (1, 2)]
