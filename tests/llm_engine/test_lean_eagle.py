"""The EAGLE head on the lean forward (`llm_engine.lean.eagle`), on tiny random models: the same
features as HF's layer, its cache kept to the committed positions, and lossless speculation."""

from __future__ import annotations

import torch

from llm_engine.config import SpeculationConfig
from llm_engine.lean.eagle import LeanEagleHead
from llm_engine.lean.runner import LeanRunner
from tests.llm_engine.requests import accepted_with_equal_output, plain_and_speculative
from tests.llm_engine.test_eagle import features, head  # noqa: F401 (a fixture)
from tests.llm_engine.test_engine import NEW_TOKENS, random_prompts


def test_in_float32_the_lean_head_predicts_hfs_features_through_its_cache(target, head):  # noqa: F811
    lean = LeanEagleHead(head, "float32", 256)
    tokens = [3, 9, 27, 81, 5, 11]
    f, t = features(target, tokens[:-1]), torch.tensor([tokens[1:]])
    with torch.inference_mode():
        want = head(f[None], t)  # [1, 5, hidden], uncached
        cache = lean.new_cache()
        first = lean(f[None, :3], t[:, :3], cache)
        rest = lean(f[None, 3:], t[:, 3:], cache)
        same_vocabulary = torch.equal(lean.logits(want[0]).isinf(), head.logits(want[0]).isinf())
    assert lean.length(cache) == 5
    assert torch.allclose(torch.cat([first, rest], dim=1), want, atol=1e-4)
    assert same_vocabulary


def test_eagle_on_the_lean_runner_drafts_and_equals_plain_decoding(target, tokenizer, head):  # noqa: F811
    runner = LeanRunner(target, "q4", max_cache_len=256, max_rows=6)
    lean_head = LeanEagleHead(head, "q4", 256, runner.lean.attention_dtype)
    speculation = SpeculationConfig(method="eagle", max_draft_tokens=5, gate=False)
    off, spec = plain_and_speculative(target, tokenizer, runner, speculation, NEW_TOKENS,
                                      eagle_head=lean_head)
    prompts = random_prompts(len(tokenizer), 8, seed=12)
    assert accepted_with_equal_output(spec, off, prompts) > 0
    state = spec.start(random_prompts(len(tokenizer), 1, seed=13)[0])
    for _ in range(5):  # the head's cache never keeps a drafted position
        spec.step(state)
        assert lean_head.length(state.proposer.cache) <= len(state.token_ids) - 1
    spec.release(state)
