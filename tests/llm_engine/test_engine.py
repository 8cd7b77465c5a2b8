"""The engine end to end on tiny random models: lossless output, stopping, cancel, reuse, stats."""

from __future__ import annotations

import json
import random
import threading

import pytest
import torch

from llm_engine.config import EngineConfig, GrammarSpec, SamplingConfig, SpeculationConfig
from llm_engine.cost_model import CostModel
from llm_engine.engine import SpeculativeEngine
from llm_engine.runner import EagerRunner
from tests.llm_engine.requests import run

NEW_TOKENS = 24
NUM_PROMPTS = 50


def random_prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 24))] for _ in range(count)]


def hf_greedy(model, prompt: list[int], new_tokens: int, eos=2) -> list[int]:
    """The reference: transformers' own greedy generate, target model only."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos
    )
    return out[0, len(prompt) :].tolist()


def make_engine(target, tokenizer, method="off", draft=None, sampling=None, eagle=None,
                chunk=256, **spec):
    config = EngineConfig(
        speculation=SpeculationConfig(method=method, **spec),
        sampling=sampling or SamplingConfig(max_new_tokens=NEW_TOKENS),
        prefill_chunk=chunk,
    )
    return SpeculativeEngine(target, tokenizer, config, draft_model=draft, eagle_head=eagle)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return random_prompts(len(tokenizer), NUM_PROMPTS)


@pytest.fixture(scope="module")
def reference(target, prompts):
    return [hf_greedy(target, p, NEW_TOKENS) for p in prompts]


# -- lossless greedy ------------------------------------------------------------------------------


def test_greedy_off_equals_target_only(target, tokenizer, prompts, reference):
    engine = make_engine(target, tokenizer, "off")
    assert [run(engine, p)[0] for p in prompts] == reference


def test_greedy_with_disagreeing_draft_equals_target_only(
    target, draft, tokenizer, prompts, reference
):
    # Fixed K and no gate, so every step really speculates and most drafts are rejected.
    engine = make_engine(target, tokenizer, "draft", draft, adaptive=False, gate=False)
    assert [run(engine, p)[0] for p in prompts] == reference
    assert engine.totals.accepted < 0.5 * engine.totals.drafted


def test_greedy_with_agreeing_draft_equals_target_only(target, tokenizer, prompts, reference):
    engine = make_engine(target, tokenizer, "draft", target, adaptive=False, gate=False)
    assert [run(engine, p)[0] for p in prompts] == reference
    assert engine.totals.accepted == engine.totals.drafted > 0


def test_greedy_ngram_equals_target_only(target, tokenizer, prompts, reference):
    engine = make_engine(target, tokenizer, "ngram", gate=False)
    assert [run(engine, p)[0] for p in prompts] == reference
    assert engine.totals.drafted > 0


def test_gated_and_adaptive_speculation_gives_the_same_tokens(
    target, draft, tokenizer, prompts, reference
):
    engine = make_engine(target, tokenizer, "draft", draft)  # defaults: adaptive K and the gate
    assert [run(engine, p)[0] for p in prompts[:20]] == reference[:20]
    assert engine.totals.gated_requests > 0  # a random draft never pays for itself


def test_target_as_its_own_draft_accepts_all_and_commits_k_plus_1(target, tokenizer, prompts):
    k = 4
    engine = make_engine(
        target, tokenizer, "draft", target, num_draft_tokens=k, adaptive=False, gate=False
    )
    sampling = SamplingConfig(max_new_tokens=1 + 5 * (k + 1))  # the first token, then 5 steps
    checked = 0
    for prompt in prompts[:5]:
        tokens, state = run(engine, prompt, sampling)
        if state.finish_reason == "eos":
            continue  # a random model may stop early; the other prompts still count
        checked += 1
        assert [(s.drafted, s.accepted, s.committed) for s in state.stats.steps] == [
            (k, k, k + 1)
        ] * 5
        assert state.stats.acceptance_rate == 1.0
    assert checked >= 3


class RowCountingRunner(EagerRunner):
    """The eager runner, noting how many rows each forward ran."""

    def __init__(self, model):
        super().__init__(model)
        self.rows: list[int] = []

    def forward(self, cache, input_ids, last_only=False):
        self.rows.append(input_ids.shape[1])
        return super().forward(cache, input_ids, last_only)


def test_a_short_draft_is_padded_to_a_cheaper_row_count_without_changing_the_output(
        target, tokenizer, prompts, reference):
    runner = RowCountingRunner(target)
    costs = CostModel([10.0, 30.0, 30.0, 12.0, 14.0], context=64)  # 4 rows: nearly one
    engine = SpeculativeEngine(
        target, tokenizer,
        EngineConfig(speculation=SpeculationConfig(method="draft", num_draft_tokens=1,
                                                    adaptive=False, gate=False),
                     sampling=SamplingConfig(max_new_tokens=NEW_TOKENS)),
        draft_model=target, runner=runner, cost_model=costs)
    tokens, state = run(engine, prompts[0])
    assert tokens == reference[0]
    assert [s.k for s in state.stats.steps][:3] == [1, 1, 1]
    assert runner.rows[1:4] == [4, 4, 4]  # after the prefill: 2 rows padded to 4


# -- stopping -------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 8, 13])
def test_max_new_tokens_is_exact(target, tokenizer, max_new_tokens):
    engine = make_engine(target, tokenizer, "draft", target, adaptive=False, gate=False)
    engine.eos_token_ids = frozenset()
    tokens, state = run(engine, [5, 17, 42], SamplingConfig(max_new_tokens=max_new_tokens))
    assert len(tokens) == max_new_tokens
    assert state.finish_reason == "length"


def test_eos_inside_an_accepted_draft_stops_there(target, tokenizer, prompts):
    # Steps of K=4 with the target as draft cover positions 1-5, 6-10, ...: position 7 is the
    # second draft token of a step. Make the token generated there the EOS.
    prompt, plain = next(
        (p, plain)
        for p in prompts
        if (plain := hf_greedy(target, p, 12, eos=None))[7] not in plain[:7]
    )
    engine = make_engine(target, tokenizer, "draft", target, adaptive=False, gate=False)
    engine.eos_token_ids = frozenset({plain[7]})
    tokens, state = run(engine, prompt)
    assert tokens == plain[:8]
    assert state.finish_reason == "eos"
    last = state.stats.steps[-1]
    assert last.accepted == 4 and last.committed == 2


def test_ignore_eos_decodes_every_token_past_eos(target, tokenizer, prompts):
    prompt = prompts[0]
    plain = hf_greedy(target, prompt, 12, eos=None)
    engine = make_engine(target, tokenizer, "draft", target, adaptive=False, gate=False)
    engine.eos_token_ids = frozenset({plain[3]})
    tokens, state = run(engine, prompt, SamplingConfig(max_new_tokens=12, ignore_eos=True))
    assert tokens == plain and state.finish_reason == "length"


def test_ignore_eos_cannot_go_with_a_grammar():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingConfig(ignore_eos=True,
                       grammar=GrammarSpec(kind="json_schema", json_schema={"type": "object"}))


def test_prompt_longer_than_the_context_is_refused(target, tokenizer):
    engine = make_engine(target, tokenizer)
    with pytest.raises(ValueError, match="max_context"):
        engine.start(list(range(3, 3 + engine.config.max_context)))


# -- sampling -------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_seeded_sampling_runs_are_reproducible(target, draft, tokenizer, method):
    engine = make_engine(target, tokenizer, method, draft)
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=123, max_new_tokens=NEW_TOKENS)
    prompt = [5, 17, 42, 5, 17, 42, 5, 17]
    first, _ = run(engine, prompt, sampling)
    second, _ = run(engine, prompt, sampling)
    other, _ = run(engine, prompt, SamplingConfig(temperature=0.9, seed=7, max_new_tokens=24))
    assert first == second
    assert first != other


# -- cancellation ---------------------------------------------------------------------------------


def test_cancel_mid_request_stops_at_next_step_and_frees_kv(target, draft, tokenizer, prompts):
    engine = make_engine(target, tokenizer, "draft", draft, gate=False)
    state = engine.start(prompts[0])
    emitted = engine.step(state) + engine.step(state)
    canceller = threading.Thread(target=state.cancel)  # as the asyncio side would
    canceller.start()
    canceller.join()
    assert engine.step(state) == []
    assert state.finished and state.finish_reason == "cancelled"
    assert state.output_ids == emitted
    assert state.stats.cancel_to_stop_ms is not None
    engine.release(state)
    assert state.cache is None
    assert state.proposer.cache is None  # the draft's KV is freed too


def test_request_after_a_cancel_is_unaffected(target, draft, tokenizer, prompts, reference):
    engine = make_engine(target, tokenizer, "draft", draft, gate=False)
    state = engine.start(prompts[0])
    engine.step(state)
    engine.step(state)
    state.cancel()
    engine.step(state)
    engine.release(state)
    assert run(engine, prompts[1])[0] == reference[1]
    assert engine.totals.finish_reasons["cancelled"] == 1


def test_cancel_before_prefill_does_no_work(target, tokenizer, prompts):
    engine = make_engine(target, tokenizer)
    state = engine.start(prompts[0])
    state.cancel()
    assert engine.step(state) == []
    assert state.finish_reason == "cancelled" and state.stats.prefill_tokens == 0


def test_a_long_prompt_is_prefilled_in_chunks_with_the_same_output(target, tokenizer):
    prompt = [5 + (i * 7) % 300 for i in range(50)]
    engine = make_engine(target, tokenizer, "ngram", chunk=16)
    state = engine.start(prompt)
    assert [engine.step(state) for _ in range(3)] == [[], [], []]  # 16 + 16 + 16 tokens
    assert state.stats.prefill_tokens == 48 and not state.prefilled
    first = engine.step(state)  # the last 2 tokens, then the first new token
    assert len(first) == 1 and state.prefilled and state.stats.prefill_tokens == 50
    while not state.finished:
        first += engine.step(state)
    assert first == run(make_engine(target, tokenizer, "ngram"), prompt)[0]


def test_a_cancel_during_a_chunked_prefill_stops_at_the_next_chunk(target, tokenizer):
    engine = make_engine(target, tokenizer, chunk=8)
    state = engine.start(list(range(5, 45)))
    engine.step(state)
    state.cancel()
    assert engine.step(state) == []
    assert state.finish_reason == "cancelled" and state.stats.prefill_tokens == 8


# -- prefix reuse ---------------------------------------------------------------------------------


def test_prefix_reuse_prefills_only_the_new_suffix(target, draft, tokenizer, prompts):
    engine = make_engine(target, tokenizer, "draft", draft)
    _, turn1 = run(engine, prompts[0], session_id="call")
    turn2_prompt = turn1.token_ids + [7, 8, 9, 10]
    tokens, turn2 = run(engine, turn2_prompt, session_id="call")
    cached = len(turn1.token_ids) - 1  # the last token of a turn is never run through the model
    assert turn2.stats.reused_prefix_tokens == cached
    assert turn2.stats.prefill_tokens == len(turn2_prompt) - cached
    fresh = make_engine(target, tokenizer, "draft", draft)
    assert tokens == run(fresh, turn2_prompt)[0]


def test_prefix_reuse_crops_to_the_shared_prefix_after_an_edit(target, tokenizer, prompts):
    engine = make_engine(target, tokenizer, "ngram")
    run(engine, prompts[0] + prompts[1], session_id="call")
    edited = prompts[0] + [99, 98, 97]  # the second part was replaced (a barge-in, say)
    tokens, state = run(engine, edited, session_id="call")
    assert state.stats.reused_prefix_tokens == len(prompts[0])
    assert tokens == run(make_engine(target, tokenizer, "ngram"), edited)[0]


def test_sessions_do_not_share_kv(target, tokenizer, prompts):
    engine = make_engine(target, tokenizer)
    run(engine, prompts[0], session_id="a")
    _, state = run(engine, prompts[0] + [5], session_id="b")
    assert state.stats.reused_prefix_tokens == 0


def test_a_request_that_outlives_its_dropped_session_frees_its_kv(target, tokenizer, prompts):
    engine = make_engine(target, tokenizer)
    state = engine.start(prompts[0], session_id="ended-call")
    engine.step(state)  # in flight when the call ends
    engine.drop_session("ended-call")
    engine.release(state)
    assert state.cache is None
    _, later = run(engine, prompts[0] + [5], session_id="ended-call")
    assert later.stats.reused_prefix_tokens == 0  # nothing was kept for the ended call


# -- scheduling and stats -------------------------------------------------------------------------


def test_interleaved_requests_match_sequential_ones(target, draft, tokenizer, prompts, reference):
    engine = make_engine(target, tokenizer, "draft", draft)
    states = [engine.start(p) for p in prompts[:3]]
    outputs = [[] for _ in states]
    while not all(s.finished for s in states):
        for state, out in zip(states, outputs, strict=True):
            out += engine.step(state)  # round robin at step granularity
    assert outputs == reference[:3]


def test_request_stats_are_complete_and_serialisable(target, tokenizer, prompts):
    engine = make_engine(target, tokenizer, "draft", target, gate=False)
    tokens, state = run(engine, prompts[0])
    stats = state.stats
    assert stats.ttft_ms is not None and stats.prefill_ms > 0
    assert len(stats.itl_ms) == len(tokens) - 1 == stats.generated_tokens - 1
    assert len(stats.k_history) == len(stats.steps)
    assert sum(stats.accept_len_hist) == sum(1 for s in stats.steps if s.drafted)
    assert stats.accepted_by_pos[0] <= stats.drafted_by_pos[0]
    assert stats.tokens_per_s > 0
    payload = json.loads(json.dumps(stats.to_dict()))
    assert payload["method"] == "draft" and payload["finish_reason"] == state.finish_reason
    assert engine.totals.requests == 1 and engine.totals.generated_tokens == len(tokens)


def test_generate_yields_each_steps_tokens(target, tokenizer, prompts, reference):
    engine = make_engine(target, tokenizer, "ngram")
    chunks = list(engine.generate(prompts[0]))
    assert all(chunks) and sum(chunks, []) == reference[0]


def test_draft_method_without_a_draft_model_fails_at_construction(target, tokenizer):
    with pytest.raises(ValueError, match="draft model"):
        make_engine(target, tokenizer, "draft")
