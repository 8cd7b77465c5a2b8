"""q4 on the embedded target: the GGUF's Q4_1 codes and its Q8_0 head go into the kernel
unchanged, and greedy speculation on the lean runner is token-identical to its plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.cost_model import cpu_model
from llm_engine.engine import SpeculativeEngine
from llm_engine.lean.gguf import read_q4_1, read_q8_0_head
from llm_engine.lean.linear import Int4Linear, Q8Linear
from llm_engine.lean.llama import LeanLlama
from llm_engine.lean.runner import LeanRunner
from llm_engine.prompts import encode_chat
from voiceagent.prompt_sets import heldout_conversations


@pytest.fixture(scope="module")
def q4(smollm2):
    return LeanRunner(smollm2.model, "q4", 1024, 11, Path(smollm2.source))


def test_the_readers_q4_1_blocks_are_what_transformers_de_quantised(smollm2):
    config = smollm2.model.config
    blocks = read_q4_1(smollm2.source, config.num_attention_heads, config.num_key_value_heads)
    params = dict(smollm2.model.named_parameters())
    assert len(blocks) == 7 * config.num_hidden_layers
    for name, weight in blocks.items():
        assert torch.equal(weight.dequantised(), params[name].detach()), name


def test_the_q4_codes_are_the_ggufs(smollm2, q4):
    config = smollm2.model.config
    blocks = read_q4_1(smollm2.source, config.num_attention_heads, config.num_key_value_heads)
    names = [f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv"]
    assert torch.equal(q4.lean.layers[3].qkv.codes, torch.cat([blocks[n].codes for n in names]))


def test_the_q4_weights_are_the_files_or_round_only_in_scales_and_zeros(smollm2,
                                                                         int_kernel_choice):
    config = smollm2.model.config
    name = "model.layers.3.self_attn.q_proj.weight"
    block = read_q4_1(smollm2.source, config.num_attention_heads, config.num_key_value_heads)[name]
    ours = Int4Linear(block.codes, block.scales, block.mins, torch.bfloat16).dequantised()
    file = block.dequantised()
    if int_kernel_choice == "own":  # d and m in fp32: the file's weights exactly
        assert torch.equal(ours, file)
        return
    # torch's kernel: bf16 keeps 8 bits of the scale and zero: a weight moves by at most 9 of
    # their ulps
    scales = block.scales.repeat_interleave(32, dim=1)
    zeros = (block.mins + 8 * block.scales).repeat_interleave(32, dim=1)
    assert ((ours - file).abs() <= (8 * scales.abs() + zeros.abs()) * 2.0 ** -8).all()
    assert not torch.equal(ours, file)  # the rounding is real: the test would see a change


def test_the_q4_head_is_the_ggufs_q8_0_codes(smollm2, q4):
    head = read_q8_0_head(smollm2.source, "model.embed_tokens.weight")  # SmolLM2's is tied
    reference = smollm2.model.get_output_embeddings().weight.detach()
    assert torch.equal(head.dequantised(), reference)  # what transformers de-quantised
    assert isinstance(q4.lean.head, Q8Linear)
    assert torch.equal(q4.lean.head.codes, head.codes)


def test_the_q8_head_is_the_files_or_rounds_only_in_its_scales(smollm2, int_kernel_choice):
    head = read_q8_0_head(smollm2.source, "model.embed_tokens.weight")
    reference = smollm2.model.get_output_embeddings().weight.detach()
    ours = Q8Linear(head.codes, head.scales, torch.bfloat16).dequantised()
    scales = head.scales.repeat_interleave(32, dim=1)
    if int_kernel_choice == "own":  # d (q + 128) - 128 d in fp32: off by float32 rounding only
        assert ((ours - reference).abs() <= scales.abs() * 2.0 ** -15).all()
        return
    # torch's kernel: 16d, 8d and d round alike in bf16 (8 significant bits), so a weight is
    # q * bf16(d): off by at most |q| <= 128 times 2^-8 |d|
    assert ((ours - reference).abs() <= 128 * scales.abs() * 2.0 ** -8).all()
    assert not torch.equal(ours, reference)  # the rounding is real: the test would see a change


def test_a_files_head_of_another_shape_is_not_taken(smollm2):
    # A tied model whose embedding is not the file's shape keeps a head of its own.
    tiny = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    assert LeanLlama._file_head(smollm2.model, dict(smollm2.model.named_parameters()),
                                smollm2.source) is not None
    assert LeanLlama._file_head(tiny, dict(tiny.named_parameters()), smollm2.source) is None


def test_greedy_speculation_on_q4_equals_plain_decoding_on_20_held_out_prompts(
        smollm2, smollm2_costs, q4):
    def engine(method: str, **extra) -> SpeculativeEngine:
        config = EngineConfig(sampling=SamplingConfig(max_new_tokens=24), max_context=1024,
                              speculation=SpeculationConfig(method=method, gate=False))
        return SpeculativeEngine(smollm2.model, smollm2.tokenizer, config, runner=q4,
                                 cost_model=smollm2_costs, **extra)

    if q4.bit_identical is False:  # then `auto` never takes q4 here
        pytest.skip(f"q4: this CPU's kernels are row-dependent even padded ({cpu_model()})")
    off = engine("off")
    others = [engine("ngram"), engine("draft", draft_model=smollm2.model)]
    for messages in heldout_conversations()[:20]:
        prompt = encode_chat(smollm2.tokenizer, messages)
        want = off.generate(prompt)
        want = [t for step in want for t in step]
        for other in others:
            assert [t for step in other.generate(prompt) for t in step] == want
