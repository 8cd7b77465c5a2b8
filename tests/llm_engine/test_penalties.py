"""History penalties (repetition penalty, no-repeat n-grams): the processor itself, transformers'
semantics, and speculation that stays exact for the penalised target with every proposer."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from llm_engine.config import EngineConfig, GrammarSpec, SamplingConfig, SpeculationConfig
from llm_engine.cost_model import CostModel
from llm_engine.engine import SpeculativeEngine
from llm_engine.sampling import penalize
from llm_engine.verify import verify_sampling
from tests.llm_engine.requests import run
from tests.llm_engine.test_eagle import head  # noqa: F401  (the module's EAGLE head fixture)

NEW_TOKENS = 16
# Repetitive prompts, so the penalties bite and prompt lookup finds matches to draft.
PROMPTS = [[5, 17, 42, 9] * 3, [30, 31, 32, 33, 34, 30, 31, 32], [7, 8, 7, 8, 7, 8, 60],
           [9, 9, 9, 250, 251, 9, 9]]
PENALTIES = {
    "penalty": dict(repetition_penalty=1.8),
    "no-repeat": dict(no_repeat_ngram_size=2),
    "both-windowed": dict(repetition_penalty=1.5, no_repeat_ngram_size=3, penalty_last_n=8),
}
ONE_TOOL = GrammarSpec(kind="tools", tools=[{"name": "lookup_order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["order_id"], "additionalProperties": False}}])


def penalised(name: str, **extra) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=NEW_TOKENS, **PENALTIES[name], **extra)


def make_engine(target, tokenizer, method="off", draft=None, eagle=None, cls=SpeculativeEngine):
    """Fixed K, no gate (every step drafts), single-token lookups (a penalised reply rarely
    repeats two), and a flat cost model instead of measuring one."""
    spec = SpeculationConfig(method=method, adaptive=False, gate=False, num_draft_tokens=4,
                             ngram_min=1)
    return cls(target, tokenizer, EngineConfig(speculation=spec), draft_model=draft,
               eagle_head=eagle, cost_model=CostModel([10.0] * 12, context=64))


# -- the processor against hand-computed logits --------------------------------------------------

LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])  # [1, 6]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    out = penalize(LOGITS, [0, 1, 1], (), SamplingConfig(repetition_penalty=2.0))
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0, -2.0, 1.0]]


def test_each_row_sees_the_drafts_before_it():
    logits = LOGITS.repeat(3, 1)  # [3, 6]: the rows after history, + d_0, + d_0 d_1
    out = penalize(logits, [0], [3, 5], SamplingConfig(repetition_penalty=2.0))
    assert out.tolist() == [[1.0, -1.0, 0.5, 3.0, -2.0, 1.0],
                            [1.0, -1.0, 0.5, 1.5, -2.0, 1.0],
                            [1.0, -1.0, 0.5, 1.5, -2.0, 0.5]]


def test_the_window_keeps_only_the_last_tokens_of_each_row():
    logits = LOGITS.repeat(2, 1)
    out = penalize(logits, [0, 3], [5], SamplingConfig(repetition_penalty=2.0, penalty_last_n=2))
    assert out.tolist() == [[1.0, -1.0, 0.5, 1.5, -2.0, 1.0],   # window [0, 3]
                            [2.0, -1.0, 0.5, 1.5, -2.0, 0.5]]   # window [3, 5]


def test_exempt_tokens_are_never_penalised():
    out = penalize(LOGITS, [0, 3], (), SamplingConfig(repetition_penalty=2.0), exempt={3})
    assert out.tolist() == [[1.0, -1.0, 0.5, 3.0, -2.0, 1.0]]


def test_no_repeat_bans_the_tokens_that_would_repeat_an_ngram():
    # History 4 0 2 4 0 ends in (4, 0); trigrams (4, 0, 2) occurred: 2 is banned, nothing else.
    out = penalize(LOGITS, [4, 0, 2, 4, 0], (), SamplingConfig(no_repeat_ngram_size=3))
    expected = LOGITS.clone()
    expected[0, 2] = float("-inf")
    assert torch.equal(out, expected)


def test_a_ban_that_would_leave_nothing_is_skipped():
    only_two = torch.full((1, 6), float("-inf"))
    only_two[0, 2] = 1.0  # a grammar allows only token 2, which repeats the bigram (0, 2)
    out = penalize(only_two, [0, 2, 0], (), SamplingConfig(no_repeat_ngram_size=2))
    assert torch.equal(out, only_two)


def test_no_penalties_leave_the_logits_alone():
    assert penalize(LOGITS, [0, 1], (), SamplingConfig()) is LOGITS


def test_a_penalty_that_flips_signs_is_refused():
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingConfig(repetition_penalty=0.0)


# -- the engine: transformers' semantics, and exact speculation with every proposer ---------------


@pytest.mark.parametrize("name", PENALTIES)
def test_plain_decoding_matches_transformers_generate(target, tokenizer, name):
    engine = make_engine(target, tokenizer, "off")
    hf = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, **PENALTIES[name]}
    if hf.pop("penalty_last_n", 0):
        pytest.skip("transformers has no window")
    for prompt in PROMPTS:
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                   do_sample=False, eos_token_id=2, **hf)[0, len(prompt):]
        assert run(engine, prompt, penalised(name))[0] == expected.tolist()


@pytest.fixture(scope="module")
def off_outputs(target, tokenizer):
    engine = make_engine(target, tokenizer, "off")
    outputs = {name: [run(engine, p, penalised(name))[0] for p in PROMPTS] for name in PENALTIES}
    plain = [run(engine, p, SamplingConfig(max_new_tokens=NEW_TOKENS))[0] for p in PROMPTS]
    for name, tokens in outputs.items():  # the identities below would be vacuous otherwise
        assert tokens != plain, f"{name} changes nothing on these prompts"
    return outputs


@pytest.mark.parametrize("method", ["draft", "ngram", "eagle"])
@pytest.mark.parametrize("name", PENALTIES)
def test_greedy_speculation_equals_off_with_penalties(
        target, draft, tokenizer, head, off_outputs, name, method):  # noqa: F811
    engine = make_engine(target, tokenizer, method, draft, head)
    assert [run(engine, p, penalised(name))[0] for p in PROMPTS] == off_outputs[name]
    # A penalty over the whole history leaves prompt lookup no repeat to find: nothing drafted.
    assert engine.totals.drafted > 0 or (method, name) == ("ngram", "penalty")


@pytest.mark.parametrize("name", PENALTIES)
def test_the_target_as_its_own_draft_accepts_everything_with_penalties(
        target, tokenizer, off_outputs, name):
    # Exact greedy output holds even with an unpenalised q; full acceptance needs q penalised
    # with the same history as p.
    engine = make_engine(target, tokenizer, "draft", target)
    assert [run(engine, p, penalised(name))[0] for p in PROMPTS] == off_outputs[name]
    assert engine.totals.accepted == engine.totals.drafted > 0


@pytest.mark.parametrize("method", ["grammar", "grammar+ngram", "grammar+draft"])
def test_greedy_speculation_under_a_grammar_equals_off_with_penalties(
        target, draft, tokenizer, method):
    sampling = penalised("both-windowed", grammar=ONE_TOOL)
    off = make_engine(target, tokenizer, "off")
    spec = make_engine(target, tokenizer, method, draft)
    for prompt in PROMPTS:
        assert run(spec, prompt, sampling)[0] == run(off, prompt, sampling)[0]


@pytest.mark.parametrize("name", PENALTIES)
def test_seeded_sampled_ngram_equals_off_with_penalties(target, tokenizer, name):
    off = make_engine(target, tokenizer, "off")
    ngram = make_engine(target, tokenizer, "ngram")
    for seed in range(2):
        sampling = penalised(name, temperature=0.9, seed=seed)
        for prompt in PROMPTS:
            assert run(ngram, prompt, sampling)[0] == run(off, prompt, sampling)[0]
    assert ngram.totals.drafted > 0


class DraftBlindEngine(SpeculativeEngine):
    """Wrong: every verify row penalised with the committed tokens only, blind to the drafts
    before it."""

    def _penalize(self, state, draft, logits):
        return penalize(logits, state.token_ids, (), state.sampling, self.eos_token_ids)


def test_the_identity_check_catches_rows_penalised_without_their_drafts(
        target, tokenizer, off_outputs):
    engine = make_engine(target, tokenizer, "draft", target, cls=DraftBlindEngine)
    got = [run(engine, p, penalised("penalty"))[0] for p in PROMPTS]
    assert got != off_outputs["penalty"]


# -- sampled verification follows the penalised target's distribution ----------------------------
#
# A toy target and draft over 4 tokens whose logits depend on the position only; the penalties
# make each position's distribution depend on the tokens before it. Every sample drafts the whole
# sequence from q (penalised, or not: `q_penalised`) and verifies it with rejection sampling on p
# rows penalised with the history up to each row (or, wrongly, with the committed tokens only).

VOCAB_S, LENGTH, SAMPLES, TV_BOUND = 4, 3, 20_000, 0.04  # as test_verify's distribution checks
BASE_P = torch.tensor([[1.0, 0.5, 0.0, -0.5], [0.2, 1.0, 0.6, 0.0], [0.9, 0.8, 0.1, 0.3]])
BASE_Q = torch.tensor([[0.0, 0.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.5], [0.0, 1.0, 0.2, 0.0]])
TOY = SamplingConfig(temperature=1.0, repetition_penalty=3.0)
PROMPT = (1,)


@cache
def _probs(draft: bool, history: tuple[int, ...], drafts: tuple[int, ...] = (),
           blind: bool = False) -> torch.Tensor:
    """The toy draft's (or target's) penalised rows after `history`, one per draft and one more;
    `blind`: wrongly penalised with `history` alone."""
    rows = (BASE_Q if draft else BASE_P)[len(history) - len(PROMPT):][: len(drafts) + 1]
    return torch.softmax(penalize(rows, history, () if blind else drafts, TOY), dim=-1)


def _sample_toy(seed: int, q_penalised: bool = True, rows_see_drafts: bool = True):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB_S**LENGTH)
    for _ in range(SAMPLES):
        history = PROMPT
        while len(history) - len(PROMPT) < LENGTH:
            drafts, q_rows = (), []
            for _ in range(LENGTH - (len(history) - len(PROMPT)) - 1):
                q = _probs(True, history + drafts)[0]
                if not q_penalised:
                    q = torch.softmax(BASE_Q[len(history) + len(drafts) - len(PROMPT)], dim=-1)
                drafts += (int(torch.multinomial(q, 1, generator=gen)),)
                q_rows.append(q)
            p = _probs(False, history, drafts, not rows_see_drafts)  # [k + 1, VOCAB_S]
            q = torch.stack(q_rows) if q_rows else None
            result = verify_sampling(torch.tensor(drafts, dtype=torch.long), q, p, gen)
            history += tuple(result.tokens)
        index = 0
        for token in history[len(PROMPT):][:LENGTH]:
            index = index * VOCAB_S + token
        counts[index] += 1
    return counts


@cache
def _toy_joint() -> torch.Tensor:
    joint = torch.zeros(VOCAB_S**LENGTH)
    for index in range(VOCAB_S**LENGTH):
        tokens = [index // VOCAB_S**2, index // VOCAB_S % VOCAB_S, index % VOCAB_S]
        prob, history = 1.0, PROMPT
        for token in tokens:
            prob *= _probs(False, history)[0, token].item()
            history += (token,)
        joint[index] = prob
    return joint


def _tv(counts: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - _toy_joint()).abs().sum().item()


def test_sampled_speculation_follows_the_penalised_target_distribution():
    assert _tv(_sample_toy(seed=0)) < TV_BOUND


def test_the_distribution_check_catches_rows_penalised_without_their_drafts():
    tv = _tv(_sample_toy(seed=1, rows_see_drafts=False))
    assert tv > TV_BOUND, f"draft-blind rows passed the check (tv={tv:.3f})"


def test_an_unpenalised_q_is_still_exact_when_drafts_come_from_it():
    # Rejection sampling is exact for any q the drafts are drawn from: penalising q only buys
    # acceptance, which the own-draft test above checks.
    assert _tv(_sample_toy(seed=2, q_penalised=False)) < TV_BOUND
