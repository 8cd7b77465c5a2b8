"""The EAGLE head and the `eagle` proposer on tiny random models: losslessness and bookkeeping."""

from __future__ import annotations

import pytest
import torch

from llm_engine import eagle_head, kv
from llm_engine.config import SamplingConfig
from llm_engine.proposers import ProposeContext
from llm_engine.sampling import make_generator
from tests.llm_engine.test_engine import NEW_TOKENS, hf_greedy, make_engine, random_prompts, run


@pytest.fixture(scope="module")
def head(target, tokenizer):
    torch.manual_seed(0)
    ids = torch.arange(0, len(tokenizer), 3)
    made = eagle_head.build_from_target(target, ids)
    with torch.no_grad():  # a trained head's fc mixes token and feature: make this one do so too
        made.fc.weight.add_(0.05 * torch.randn_like(made.fc.weight))
    return made.eval()


def features(target, tokens: list[int]) -> torch.Tensor:
    """The target's last hidden states over `tokens`, in one uncached forward [n, hidden]."""
    with torch.inference_mode():
        return target(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]


def test_logits_outside_the_head_vocabulary_are_minus_infinity(target, head, tokenizer):
    f = features(target, [5, 6, 7])
    logits = head.logits(head(f[None], torch.tensor([[6, 7, 8]])))  # [1, 3, vocab]
    inside = torch.zeros(len(tokenizer), dtype=torch.bool)
    inside[head.head.vocab_ids] = True
    assert torch.isinf(logits[..., ~inside]).all() and torch.isfinite(logits[..., inside]).all()


def test_the_head_shares_the_targets_embeddings_and_saves_only_its_own(target, head):
    assert head._embed[0] is target.get_input_embeddings()
    assert not any("embed" in k for k in head.state_dict())


def test_save_and_load_give_the_same_outputs(target, head, tmp_path):
    eagle_head.save(head, tmp_path, {"vocab_size": 7}, dtype=torch.float32)
    loaded = eagle_head.load(tmp_path, target)
    f, t = features(target, [3, 9, 27, 81]), torch.tensor([[9, 27, 81, 5]])
    with torch.inference_mode():
        assert torch.equal(head(f[None], t), loaded(f[None], t))
    assert eagle_head.read_meta(tmp_path)["kind"] == "eagle"


def test_a_head_for_another_target_shape_is_refused(head, tmp_path):
    from tests.llm_engine.tiny_models import make_model

    eagle_head.save(head, tmp_path, {})
    with pytest.raises(ValueError, match="does not fit this target"):
        eagle_head.load(tmp_path, make_model(400, hidden=32))


def test_greedy_with_eagle_equals_target_only(target, tokenizer, head):
    engine = make_engine(target, tokenizer, "eagle", eagle=head, gate=False)
    prompts = random_prompts(len(tokenizer), 12, seed=5)
    assert [run(engine, p)[0] for p in prompts] == [hf_greedy(target, p, NEW_TOKENS)
                                                   for p in prompts]


def test_the_proposer_holds_the_targets_features_of_the_committed_positions(
        target, tokenizer, head):
    engine = make_engine(target, tokenizer, "eagle", eagle=head, gate=False)
    state = engine.start(random_prompts(len(tokenizer), 1, seed=6)[0])
    for _ in range(6):  # prefill and five speculative steps, rejections included
        engine.step(state)
    expected = features(target, state.token_ids[:-1])
    assert torch.allclose(state.proposer._features, expected, atol=1e-4)
    engine.release(state)


def _uncached_greedy_draft(head, target, tokens: list[int], k: int) -> list[int]:
    """EAGLE's drafting rule recomputed from scratch: no cache, every position re-run."""
    f, t = features(target, tokens[:-1]), list(tokens[1:])
    out = []
    with torch.inference_mode():
        for _ in range(k):
            predicted = head(f[None], torch.tensor([t]))[0]  # [n, hidden]
            out.append(int(head.logits(predicted[-1]).argmax()))
            f, t = torch.cat([f, predicted[-1:]]), t + [out[-1]]
    return out


def test_cached_drafts_equal_drafts_recomputed_from_scratch(target, tokenizer, head):
    engine = make_engine(target, tokenizer, "eagle", eagle=head, gate=False)
    state = engine.start(random_prompts(len(tokenizer), 1, seed=7)[0])
    for _ in range(4):
        engine.step(state)
    ctx = ProposeContext(state.token_ids, 4, SamplingConfig(), make_generator(0))
    assert state.proposer.propose(ctx).tokens == _uncached_greedy_draft(
        head, target, state.token_ids, 4)
    assert kv.cache_length(state.proposer.cache) == len(state.token_ids) - 1  # drafts dropped
    engine.release(state)


def test_prefix_reuse_with_eagle_gives_the_fresh_engines_tokens(target, tokenizer, head):
    engine = make_engine(target, tokenizer, "eagle", eagle=head)
    prompt = random_prompts(len(tokenizer), 1, seed=8)[0]
    _, turn1 = run(engine, prompt, session_id="call")
    turn2_prompt = turn1.token_ids + [7, 8, 9]
    tokens, turn2 = run(engine, turn2_prompt, session_id="call")
    assert turn2.stats.reused_prefix_tokens == len(turn1.token_ids) - 1
    assert tokens == run(make_engine(target, tokenizer, "eagle", eagle=head), turn2_prompt)[0]


def test_a_session_switching_to_eagle_prefills_what_the_head_never_saw(target, tokenizer, head):
    engine = make_engine(target, tokenizer, "ngram", eagle=head)
    prompt = random_prompts(len(tokenizer), 1, seed=10)[0]
    _, turn1 = run(engine, prompt, session_id="call")
    turn2_prompt = turn1.token_ids + [7, 8, 9]
    state = engine.start(turn2_prompt, session_id="call", method="eagle")
    tokens = []
    while not state.finished:
        tokens += engine.step(state)
    engine.release(state)
    assert state.stats.reused_prefix_tokens == 0
    assert tokens == hf_greedy(target, turn2_prompt, NEW_TOKENS)


def test_seeded_sampling_with_eagle_is_reproducible(target, tokenizer, head):
    sampling = SamplingConfig(temperature=0.8, seed=7, max_new_tokens=NEW_TOKENS)
    prompt = random_prompts(len(tokenizer), 1, seed=9)[0]
    engine = make_engine(target, tokenizer, "eagle", eagle=head, sampling=sampling)
    again = make_engine(target, tokenizer, "eagle", eagle=head, sampling=sampling)
    # The same machine's cost model, as the cache gives every process: K follows it, and the
    # drafts' draws from the request's stream follow K (two measured under load can differ).
    again.cost_model = engine.cost_model
    first = run(engine, prompt)
    assert first[0] == run(again, prompt)[0] and len(first[0]) > 0


def test_eagle_method_without_a_head_fails_at_construction(target, tokenizer):
    with pytest.raises(ValueError, match="EAGLE head"):
        make_engine(target, tokenizer, "eagle")


def _head_calls(head) -> tuple[list[int], object]:
    """Positions fed per call of the head's forward, and the hook to remove."""
    fed: list[int] = []
    hook = head.register_forward_hook(lambda module, args, out: fed.append(args[0].shape[1]))
    return fed, hook


def test_a_closed_gate_never_runs_the_head(target, tokenizer, head):
    engine = make_engine(target, tokenizer, "eagle", eagle=head, gate_reprobe_steps=1000)
    fed, hook = _head_calls(head)
    try:
        state = engine.start(random_prompts(len(tokenizer), 1, seed=8)[0])
        while not state.finished and state.gate.open:
            engine.step(state)
        calls_while_open = len(fed)
        while not state.finished:
            engine.step(state)
    finally:
        hook.remove()
    assert state.gate.closed_count == 1  # a random head never pays
    assert len(fed) == calls_while_open  # not one head call after it closed
    assert all(s.drafted == 0 for s in state.stats.steps[-5:])
    engine.release(state)


def test_a_reopened_gate_catches_the_head_up_in_one_call_and_stays_lossless(
        target, tokenizer, head):
    engine = make_engine(target, tokenizer, "eagle", eagle=head, gate_reprobe_steps=4,
                         gate_probe_draft_tokens=1)
    prompt = random_prompts(len(tokenizer), 1, seed=9)[0]
    fed, hook = _head_calls(head)
    try:
        tokens, state = run(engine, prompt)
    finally:
        hook.remove()
    assert tokens == hf_greedy(target, prompt, NEW_TOKENS)
    assert state.gate.closed_count >= 1
    # The probe after four plain steps feeds the head the five positions it has not seen.
    assert max(fed[1:]) >= 5
