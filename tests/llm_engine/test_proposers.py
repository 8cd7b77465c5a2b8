"""Proposers: the registry, `off`, `ngram` (prompt lookup) and `draft` (an independent LM)."""

from __future__ import annotations

import pytest
import torch

from llm_engine import kv, methods
from llm_engine.config import SamplingConfig, SpeculationConfig
from llm_engine.proposers import ProposeContext, make_proposer, register, registered
from llm_engine.proposers.base import _REGISTRY
from llm_engine.proposers.ngram import NgramProposer
from llm_engine.sampling import make_generator

GREEDY = SamplingConfig(temperature=0.0)


def ctx(tokens: list[int], k: int, sampling: SamplingConfig = GREEDY, seed: int = 0):
    return ProposeContext(tokens, k, sampling, make_generator(seed))


def greedy_continuation(model, tokens: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([tokens]), max_new_tokens=n, do_sample=False, eos_token_id=None
    )
    return out[0, len(tokens) :].tolist()


# -- registry -------------------------------------------------------------------------------------


def test_registry_builds_each_method_by_name(target):
    for name in ("off", "ngram", "draft"):
        proposer = make_proposer(name, SpeculationConfig(), target)
        proposer.begin([5, 6, 7])
        proposer.release()
    assert set(registered()) == set(methods.names())


def test_unknown_method_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match="known: .*ngram"):
        make_proposer("medusa", SpeculationConfig())


def test_draft_method_without_a_model_is_refused():
    with pytest.raises(ValueError, match="draft model"):
        make_proposer("draft", SpeculationConfig())


def test_register_adds_a_method_without_touching_the_engine(monkeypatch):
    monkeypatch.setitem(methods.METHODS, "test-repeat", methods.Method("test-repeat", "a test"))

    @register("test-repeat")
    class RepeatLast(NgramProposer):
        @classmethod
        def create(cls, spec, model=None):
            return cls(1, 1)

    try:
        assert isinstance(make_proposer("test-repeat", SpeculationConfig()), RepeatLast)
    finally:
        del _REGISTRY["test-repeat"]


def test_a_proposer_of_a_method_the_list_lacks_is_refused():
    with pytest.raises(ValueError, match="not in llm_engine.methods"):
        register("medusa")(NgramProposer)


# -- off ------------------------------------------------------------------------------------------


def test_off_never_drafts():
    proposer = make_proposer("off", SpeculationConfig())
    proposer.begin([1, 2, 1, 2])
    draft = proposer.propose(ctx([1, 2, 1, 2], 4))
    assert draft.tokens == [] and draft.q is None


# -- ngram ----------------------------------------------------------------------------------------


def ngram(tokens: list[int], k: int, ngram_min: int = 1, ngram_max: int = 3) -> list[int]:
    proposer = NgramProposer(ngram_min, ngram_max)
    proposer.begin(tokens)
    return proposer.propose(ctx(tokens, k)).tokens


def test_ngram_drafts_what_followed_the_most_recent_match():
    #        the suffix [7, 8] occurs twice before; the later one is followed by 3, 4
    tokens = [7, 8, 1, 2, 9, 7, 8, 3, 4, 5, 7, 8]
    assert ngram(tokens, k=3) == [3, 4, 5]


def test_ngram_prefers_the_longest_match():
    # [8] alone last occurred before 6; [9, 8] occurred before 1, 2
    tokens = [9, 8, 1, 2, 5, 8, 6, 0, 9, 8]
    assert ngram(tokens, k=2, ngram_max=2) == [1, 2]
    assert ngram(tokens, k=2, ngram_max=1) == [6, 0]


def test_ngram_without_a_match_drafts_nothing():
    assert ngram([1, 2, 3, 4], k=3) == []


def test_ngram_min_excludes_shorter_matches():
    tokens = [5, 1, 2, 3, 1]  # only the 1-gram [1] matches
    assert ngram(tokens, k=2, ngram_min=1) == [2, 3]
    assert ngram(tokens, k=2, ngram_min=2) == []


def test_ngram_draft_is_capped_at_k_and_at_the_text_end():
    tokens = [4, 5, 6, 4]
    assert ngram(tokens, k=1) == [5]
    assert ngram(tokens, k=9) == [5, 6, 4]


def test_ngram_looks_up_generated_tokens_too():
    proposer = NgramProposer(2, 2)
    proposer.begin([1, 2, 3])
    assert proposer.propose(ctx([1, 2, 3], 2)).tokens == []
    generated = [1, 2, 3, 9, 8, 9, 8]  # the model repeated [9, 8]: it matches its first copy
    assert proposer.propose(ctx(generated, 2)).tokens == [9, 8]


# -- draft model ----------------------------------------------------------------------------------


def test_draft_model_greedy_drafts_its_own_argmax_chain(target):
    prompt = [5, 17, 42, 9, 3]
    proposer = make_proposer("draft", SpeculationConfig(), target)
    proposer.begin(prompt)
    assert proposer.propose(ctx(prompt, 4)).tokens == greedy_continuation(target, prompt, 4)


def test_draft_model_sampled_returns_q_for_each_drafted_token(draft):
    proposer = make_proposer("draft", SpeculationConfig(), draft)
    proposer.begin([5, 17, 42])
    out = proposer.propose(ctx([5, 17, 42], 3, SamplingConfig(temperature=0.8, top_k=20)))
    assert len(out.tokens) == 3
    assert out.q.shape == (3, draft.config.vocab_size)
    assert torch.allclose(out.q.sum(-1), torch.ones(3))
    assert (out.q[torch.arange(3), torch.tensor(out.tokens)] > 0).all()
    assert ((out.q > 0).sum(-1) <= 20).all()  # top-k applied to q as to p


def test_draft_model_rollback_leaves_no_stale_position(target):
    prompt = [5, 17, 42, 9, 3]
    proposer = make_proposer("draft", SpeculationConfig(), target)
    proposer.begin(prompt)
    drafted = proposer.propose(ctx(prompt, 4)).tokens
    proposer.update(num_accepted=1)  # d0 kept; d1 rejected and replaced by another token
    assert kv.cache_length(proposer.cache) == len(prompt) + 1
    committed = prompt + [drafted[0], (drafted[1] + 1) % 100]
    fresh = make_proposer("draft", SpeculationConfig(), target)
    fresh.begin(committed)
    assert proposer.propose(ctx(committed, 3)).tokens == fresh.propose(ctx(committed, 3)).tokens


def test_draft_model_all_accepted_keeps_every_fed_draft(target):
    prompt = [5, 17, 42]
    proposer = make_proposer("draft", SpeculationConfig(), target)
    proposer.begin(prompt)
    proposer.propose(ctx(prompt, 4))
    proposer.update(num_accepted=4)
    assert kv.cache_length(proposer.cache) == len(prompt) + 3  # d3 itself was never fed


def test_draft_model_begin_keeps_the_shared_prefix(target):
    proposer = make_proposer("draft", SpeculationConfig(), target)
    proposer.begin([5, 17, 42, 9])
    proposer.propose(ctx([5, 17, 42, 9, 3], 2))
    proposer.update(num_accepted=2)
    proposer.begin([5, 17, 8, 8, 8])
    assert kv.cache_length(proposer.cache) == 2
