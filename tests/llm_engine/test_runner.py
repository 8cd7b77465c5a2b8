"""Target runners on tiny random models: what the engine gets back, and the compiled runner."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from llm_engine import kv
from llm_engine.compiled_runner import CompiledRunner
from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine
from llm_engine.formats import convert
from llm_engine.runner import EagerRunner
from tests.llm_engine.test_engine import NEW_TOKENS, random_prompts, run

TOKENS = torch.tensor([[5, 17, 99, 3, 250, 42, 7]])


def test_logits_come_back_in_float32_from_a_bf16_model(target):
    runner = EagerRunner(convert(target, "bfloat16"))
    with torch.inference_mode():
        out = runner.forward(runner.new_cache(), TOKENS)
    assert out.logits.dtype == torch.float32 and out.hidden.dtype == torch.bfloat16
    assert out.logits.shape == (7, target.config.vocab_size)
    assert runner.format == "bfloat16"


def test_the_hidden_states_are_what_the_head_reads(target):
    runner = EagerRunner(target)
    with torch.inference_mode():
        out = runner.forward(runner.new_cache(), TOKENS)
        reference = target(TOKENS, output_hidden_states=True)
    assert torch.equal(out.hidden, reference.hidden_states[-1][0])
    assert torch.equal(out.logits, reference.logits[0])


def test_last_only_scores_just_the_last_row_and_grows_the_cache_by_all(target):
    runner = EagerRunner(target)
    cache = runner.new_cache()
    with torch.inference_mode():
        out = runner.forward(cache, TOKENS, last_only=True)
    assert out.logits.shape[0] == 1 and out.hidden.shape[0] == 7
    assert runner.length(cache) == 7
    runner.crop(cache, 3)
    assert runner.length(cache) == 3


def test_a_model_that_transforms_its_head_output_runs_through_its_own_forward():
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16, final_logit_softcapping=5.0)
    model = Gemma2ForCausalLM(config).eval()
    runner = EagerRunner(model)
    with torch.inference_mode():
        out = runner.forward(runner.new_cache(), TOKENS)
        reference = model(TOKENS).logits[0]
    assert not kv.plain_head(model)
    assert out.logits.abs().max() <= 5.0  # soft-capped
    assert torch.allclose(out.logits, reference, atol=1e-5)


@pytest.fixture(scope="module")
def compiled(target):
    return CompiledRunner(target, max_cache_len=128, buckets=(1, 4))


def test_the_compiled_runner_pads_to_its_bucket_and_matches_eager(target, compiled):
    eager = EagerRunner(target)
    e_cache, c_cache = eager.new_cache(), compiled.new_cache()
    with torch.inference_mode():
        eager.forward(e_cache, TOKENS)
        compiled.forward(c_cache, TOKENS)  # 7 rows: past the largest bucket, eager on the cache
        for rows, bucket in (([9], 1), ([9, 10, 11], 4)):
            ids = torch.tensor([rows])
            want = eager.forward(e_cache, ids)
            got = compiled.forward(c_cache, ids)
            assert compiled.length(c_cache) == 7 + bucket  # 3 rows padded to the 4-row bucket
            assert torch.allclose(got.logits, want.logits, atol=1e-4)
            assert got.logits.shape[0] == len(rows)
            compiled.crop(c_cache, 7)
            eager.crop(e_cache, 7)


def test_the_engine_on_the_compiled_runner_is_lossless(target, tokenizer, compiled):
    config = EngineConfig(speculation=SpeculationConfig(method="draft", max_draft_tokens=3),
                          sampling=SamplingConfig(max_new_tokens=NEW_TOKENS), max_context=128)
    eager_engine = SpeculativeEngine(target, tokenizer, config, draft_model=target)
    engine = SpeculativeEngine(target, tokenizer, config, draft_model=target, runner=compiled,
                               cost_model=eager_engine.cost_model)
    for prompt in random_prompts(len(tokenizer), 3, seed=7):
        want, _ = run(eager_engine, prompt)
        got, state = run(engine, prompt)
        assert got == want
        assert state.stats.accepted > 0  # the target drafting for itself: verified rows


def test_the_compiled_runner_crops_by_its_own_counter_where_static_layers_cannot(target):
    """transformers 5.17's StaticLayer has the length counter but no crop; the runner must crop
    there too (it failed on a GPU machine with that version)."""
    runner = CompiledRunner(target, 32, buckets=(1,))
    cache = runner.new_cache()
    runner.forward(cache, TOKENS)
    for layer in cache.layers:
        layer.crop = None  # as on 5.17: calling it would fail
    runner.crop(cache, 3)
    assert runner.length(cache) == 3
