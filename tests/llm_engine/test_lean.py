"""The lean runner (`llm_engine.lean`) on tiny random Llamas: the forward against HF's, a row's
logits independent of the row count in every format, and greedy speculation equal to `off`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.cost_model import cpu_model
from llm_engine.engine import SpeculativeEngine
from llm_engine.lean import linear
from llm_engine.lean.llama import LeanLlama, fastest_attention_dtype, supports
from llm_engine.lean.runner import LeanRunner
from llm_engine.runner import EagerRunner
from tests.llm_engine.int_rows import quantised_rows
from tests.llm_engine.requests import accepted_with_equal_output, plain_and_speculative
from tests.llm_engine.test_engine import NEW_TOKENS, hf_greedy, random_prompts, run

MAX_ROWS = 6  # K_max + 1 with max_draft_tokens 5
LEAN_FORMATS = ["bfloat16", "int8", "q4"]


def lean(target, fmt: str, attention: torch.dtype | None = None,
         cache_slots: int = 0) -> LeanRunner:
    return LeanRunner(target, fmt, max_cache_len=256, max_rows=MAX_ROWS,
                      attention_dtype=attention, cache_slots=cache_slots)


def invariant(target, fmt: str, attention: torch.dtype | None = None,
              cache_slots: int = 0) -> LeanRunner:
    """The runner, where its rows are bit-identical here; else a visible skip (`auto` then never
    takes the format on this CPU, which the probe's own tests cover)."""
    runner = lean(target, fmt, attention, cache_slots)
    if runner.bit_identical is False:
        pytest.skip(f"{fmt}: this CPU's kernels are row-dependent even padded ({cpu_model()})")
    return runner


def test_the_float32_lean_forward_computes_hfs_logits(target):
    runner = lean(target, "float32")
    ids = torch.tensor([random_prompts(target.config.vocab_size, 1, seed=3)[0]])
    with torch.inference_mode():
        got = runner.forward(runner.new_cache(), ids).logits
        want = target(ids).logits[0]
    assert torch.allclose(got, want, atol=1e-4)


def test_the_float32_lean_forward_decodes_hfs_logits_after_a_prefill(target, int_kernel_choice):
    """A prefill past the short forwards' rows (SDPA), then steps of one row and a verify of
    three (our own attention op where it runs): each position's logits are HF's."""
    prompt = random_prompts(target.config.vocab_size, 1, seed=4)[0]
    ids = torch.tensor([(prompt * 8)[:48]])
    runner = lean(target, "float32")
    assert runner.lean.own_ops == (int_kernel_choice == "own")
    with torch.inference_mode():
        want = target(ids).logits[0]
        cache = runner.new_cache()
        got = [runner.forward(cache, ids[:, :40]).logits]
        got += [runner.forward(cache, ids[:, p:p + 1]).logits for p in range(40, 45)]
        got.append(runner.forward(cache, ids[:, 45:48]).logits)
    assert torch.allclose(torch.cat(got), want, atol=1e-4)


def test_the_rotary_table_gives_each_position_hfs_cos_and_sin_as_it_grows(target):
    lean = LeanLlama(target, "float32")
    positions = torch.tensor([0, 5, 63, 64, 200, 1000])
    got = [lean.rope(positions[:k], int(positions[k - 1]) + 1) for k in range(1, 7)]  # grows
    assert lean._rope_cos.shape[0] >= 1001
    x = torch.zeros(1, len(positions), target.config.hidden_size)
    want_cos, want_sin = target.model.rotary_emb(x, positions[None])
    torch.testing.assert_close(got[-1][0], want_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[-1][1], want_sin[0], rtol=1e-6, atol=1e-6)
    for k, (cos, sin) in enumerate(got, start=1):  # a position's numbers whatever the table's size
        assert torch.equal(cos, got[-1][0][:k]) and torch.equal(sin, got[-1][1][:k])


def test_float16_on_a_cpu_runs_on_torchs_ops(target):
    """Our own layer ops take fp32 and bf16 only."""
    runner = lean(target, "float16")
    ids = torch.tensor([random_prompts(target.config.vocab_size, 1, seed=3)[0]])
    assert not runner.lean.own_ops
    with torch.inference_mode():
        assert runner.forward(runner.new_cache(), ids).logits.isfinite().all()


@pytest.mark.parametrize("attention", [None, torch.float32], ids=["attention-as-activations",
                                                                  "attention-fp32"])
@pytest.mark.parametrize("fmt", LEAN_FORMATS)
def test_a_rows_logits_do_not_depend_on_how_many_rows_the_forward_carried(
        target, fmt, attention, int_kernel_choice):
    runner = invariant(target, fmt, attention)
    ids = torch.tensor([random_prompts(target.config.vocab_size, 1, seed=5)[0] * 4])
    start = 60  # the rows cross a 64-key block
    cache = runner.new_cache()
    with torch.inference_mode():
        runner.forward(cache, ids[:, :start])
        alone = []
        for j in range(MAX_ROWS):
            alone.append(runner.forward(cache, ids[:, start + j:start + j + 1]).logits)
        for rows in range(1, MAX_ROWS + 1):
            runner.crop(cache, start)
            together = runner.forward(cache, ids[:, start:start + rows]).logits
            for row in range(rows):
                assert torch.equal(together[row], alone[row][0]), (rows, row)
    assert runner.bit_identical


@pytest.mark.parametrize("fmt,attention", [("q4", None), ("bfloat16", None),
                                            ("q4", torch.float32)])
def test_greedy_speculation_on_the_lean_runner_equals_its_plain_decoding(
        target, draft, tokenizer, fmt, attention, int_kernel_choice):
    runner = invariant(target, fmt, attention)
    config = EngineConfig(sampling=SamplingConfig(max_new_tokens=NEW_TOKENS), max_context=256,
                          speculation=SpeculationConfig(method="off", max_draft_tokens=5))
    off = SpeculativeEngine(target, tokenizer, config, runner=runner)
    engines = {
        method: SpeculativeEngine(
            target, tokenizer, EngineConfig(
                sampling=config.sampling, max_context=256,
                speculation=SpeculationConfig(method=method, max_draft_tokens=5, gate=False)),
            draft_model=model, runner=runner, cost_model=off.cost_model)
        for method, model in (("ngram", None), ("draft", target), ("draft", draft))
    }
    for prompt in random_prompts(len(tokenizer), 20, seed=11):
        want, _ = run(off, prompt)
        for method, engine in engines.items():
            got, _ = run(engine, prompt)
            assert got == want, method


def test_lean_q4_greedy_mostly_follows_the_float32_model(target, tokenizer):
    """Quantised, the output moves a little, not wholesale: a sanity bound, not losslessness."""
    runner = lean(target, "q4")
    config = EngineConfig(sampling=SamplingConfig(max_new_tokens=8), max_context=256)
    engine = SpeculativeEngine(target, tokenizer, config, runner=runner)
    prompts = random_prompts(len(tokenizer), 10, seed=2)
    same = sum(run(engine, p)[0][:1] == hf_greedy(target, p, 1) for p in prompts)
    assert same >= 7


def test_fp32_attention_keeps_the_cache_in_fp32_and_moves_the_logits_only_by_rounding(target):
    ids = torch.tensor([random_prompts(target.config.vocab_size, 1, seed=3)[0]])
    as_is, fp32 = lean(target, "bfloat16"), lean(target, "bfloat16", torch.float32)
    with torch.inference_mode():
        cache = fp32.new_cache()
        got = fp32.forward(cache, ids).logits
        want = as_is.forward(as_is.new_cache(), ids).logits
    assert cache.k.dtype == torch.float32 and as_is.new_cache().k.dtype == torch.bfloat16
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_the_attention_dtype_is_the_activations_or_fp32_and_fp32_stays_fp32(target):
    assert fastest_attention_dtype(target, "float32", MAX_ROWS) == torch.float32
    assert fastest_attention_dtype(target, "q4", MAX_ROWS) in (torch.bfloat16, torch.float32)


def test_q4_quantisation_rounds_each_weight_to_its_groups_grid():
    torch.manual_seed(0)
    weight = torch.randn(16, 64)
    layer = linear.Int4Linear.quantise(weight, torch.float32)
    low = weight.reshape(16, 2, 32).amin(-1)
    step = (weight.reshape(16, 2, 32).amax(-1) - low) / 15
    # the grid as the kernel keeps it (our kernel: scale and minimum in fp16) moves each point
    # by at most the change in the minimum and 15 times the change in the step
    scales, mins = layer.scales_mins()
    moved = (mins - low).abs() + 15 * (scales - step).abs()
    error = (layer.dequantised() - weight).abs().reshape(16, 2, 32)
    assert (error <= (step / 2 + moved)[..., None] + 1e-6).all()
    assert (moved <= 2.0 ** -10 * (low.abs() + 15 * step)).all()  # fp16's rounding at most
    assert layer.codes.max() <= 15


def test_int8_quantisation_keeps_each_weight_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(16, 64)
    layer = linear.Int8Linear.quantise(weight, torch.float32)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((layer.dequantised() - weight).abs() <= step / 2 + 1e-6).all()


def test_an_8_bit_groups_layer_computes_the_product_of_its_codes(int_kernel_choice):
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (16, 64), generator=generator, dtype=torch.int32)
    scales = torch.rand(16, 2, generator=generator) * 0.01  # powers of two apart: exact in bf16
    scales = 2.0 ** torch.round(torch.log2(scales))
    layer = linear.Q8Linear(codes.to(torch.int8), scales, torch.bfloat16)
    weight = codes.float() * scales.repeat_interleave(32, dim=1)
    assert torch.equal(layer.dequantised(), weight)  # every code, every sign
    x = torch.randn(3, 64, generator=generator).bfloat16()
    if int_kernel_choice == "own":  # activations in int8 per group: the product of those
        torch.testing.assert_close(layer(x).double(), quantised_rows(x) @ weight.double().t(),
                                   rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(layer(x).float(), x.float() @ weight.t(), rtol=2e-2, atol=2e-3)


def test_an_architecture_outside_the_family_is_refused_with_the_reason():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    assert "gpt2" in supports(model)
    with pytest.raises(ValueError, match="lean forward covers"):
        LeanLlama(model, "q4")


def test_the_runners_agree_on_cache_bookkeeping(target):
    runner, eager = lean(target, "q4"), EagerRunner(target)
    for r in (runner, eager):
        cache = r.new_cache()
        with torch.inference_mode():
            out = r.forward(cache, torch.tensor([[5, 6, 7, 8]]), last_only=True)
        assert out.logits.shape == (1, target.config.vocab_size) and out.hidden.shape[0] == 4
        assert r.length(cache) == 4
        r.crop(cache, 2)
        assert r.length(cache) == 2
    with pytest.raises(ValueError, match="exceed the cache"):
        runner.forward(runner.new_cache(), torch.zeros((1, 300), dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_on_a_gpu_the_weight_only_formats_are_row_invariant_and_lossless(tokenizer, fmt):
    from tests.llm_engine.tiny_models import make_model

    model = make_model(len(tokenizer), seed=0, hidden=256).to("cuda")
    runner = LeanRunner(model, fmt, max_cache_len=256, max_rows=MAX_ROWS)
    assert runner.bit_identical
    config = EngineConfig(sampling=SamplingConfig(max_new_tokens=NEW_TOKENS), max_context=256,
                          speculation=SpeculationConfig(method="draft", max_draft_tokens=5,
                                                        gate=False))
    off = SpeculativeEngine(model, tokenizer, dataclasses.replace(
        config, speculation=SpeculationConfig(method="off", max_draft_tokens=5)), runner=runner)
    spec = SpeculativeEngine(model, tokenizer, config, draft_model=model, runner=runner,
                             cost_model=off.cost_model)
    for prompt in random_prompts(len(tokenizer), 5, seed=4):
        assert run(spec, prompt)[0] == run(off, prompt)[0]


@pytest.mark.parametrize("fmt", ["bfloat16", "q4"])
def test_a_compact_draft_on_the_lean_runner_drafts_and_stays_lossless(target, tokenizer, fmt):
    from llm_engine.compact_draft import build_from_target

    vocab_ids = torch.arange(0, target.config.vocab_size, 2)  # a head over half the vocabulary
    draft = LeanRunner(build_from_target(target, [0, 1], vocab_ids).eval(), fmt, 256, MAX_ROWS,
                       probe=False)
    assert draft.bit_identical is None
    runner = invariant(target, fmt)
    speculation = SpeculationConfig(method="draft", max_draft_tokens=5, gate=False)
    off, spec = plain_and_speculative(target, tokenizer, runner, speculation, NEW_TOKENS,
                                      draft_model=draft)
    prompts = random_prompts(len(tokenizer), 10, seed=9)
    # the target's own layers draft: many are accepted
    assert accepted_with_equal_output(spec, off, prompts) > 0
