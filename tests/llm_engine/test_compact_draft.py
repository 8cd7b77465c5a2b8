"""The compact draft (target layers + reduced-vocabulary head) on tiny random models."""

from __future__ import annotations

import torch

from llm_engine import compact_draft
from llm_engine.config import SamplingConfig
from llm_engine.engine import SpeculativeEngine
from tests.llm_engine.test_engine import NEW_TOKENS, hf_greedy, make_engine, random_prompts, run


def _draft(target, vocab_size: int, subset: int = 60):
    ids = torch.arange(0, vocab_size, vocab_size // subset)[:subset]
    return compact_draft.build_from_target(target, [0], ids), ids


def test_logits_outside_the_draft_vocabulary_are_minus_infinity(target, tokenizer):
    draft, ids = _draft(target, len(tokenizer))
    logits = draft(torch.tensor([[5, 6, 7]])).logits  # [1, 3, vocab]
    outside = torch.ones(len(tokenizer), dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(logits[..., outside]).all() and torch.isfinite(logits[..., ids]).all()


def test_the_draft_shares_the_targets_embeddings(target, tokenizer):
    draft, _ = _draft(target, len(tokenizer))
    assert draft.get_input_embeddings() is target.get_input_embeddings()
    assert not any(k.startswith("model.embed_tokens") for k in compact_draft.own_parameters(draft))


def test_save_and_load_give_the_same_logits(target, tokenizer, tmp_path):
    draft, _ = _draft(target, len(tokenizer))
    compact_draft.save(draft, tmp_path, {"layers": [0]}, dtype=torch.float32)
    loaded = compact_draft.load(tmp_path, target)
    x = torch.tensor([[3, 9, 27, 81]])
    assert torch.equal(draft(x).logits, loaded(x).logits)
    assert compact_draft.read_meta(tmp_path)["layers"] == [0]


def test_greedy_with_a_compact_draft_equals_target_only(target, tokenizer):
    draft, _ = _draft(target, len(tokenizer))
    engine = make_engine(target, tokenizer, "draft", draft=draft, gate=False)
    prompts = random_prompts(len(tokenizer), 12, seed=3)
    assert [run(engine, p)[0] for p in prompts] == [hf_greedy(target, p, NEW_TOKENS)
                                                   for p in prompts]


def test_seeded_sampling_with_a_compact_draft_is_reproducible(target, tokenizer):
    draft, _ = _draft(target, len(tokenizer))
    sampling = SamplingConfig(temperature=0.8, seed=7, max_new_tokens=NEW_TOKENS)
    prompt = random_prompts(len(tokenizer), 1, seed=4)[0]
    one = make_engine(target, tokenizer, "draft", draft=draft, sampling=sampling)
    # K follows the machine's measured costs: a second engine reads the same ones, as a second
    # process reads the cached ones (measured again under the suite's load, K could differ).
    two = SpeculativeEngine(target, tokenizer, one.config, draft_model=draft,
                            cost_model=one.cost_model)
    first, again = run(one, prompt), run(two, prompt)
    assert first[0] == again[0] and len(first[0]) > 0
