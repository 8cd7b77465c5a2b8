"""Weight formats: agreement with fp32 and the measured choice, on tiny random models."""

from __future__ import annotations

import pytest
import torch

from llm_engine import formats
from llm_engine.cost_model import CostModel
from tests.llm_engine.test_engine import random_prompts

# fp32: the cheaper plain step; bf16: a flat verify curve, where speculation pays.
CURVES = {"float32": [30.0, 90.0, 100.0, 80.0], "bfloat16": [40.0, 42.0, 44.0, 45.0]}


def synthetic(model: torch.nn.Module, fmt: str) -> CostModel:
    """Stand-in measurements: the choice logic, not this machine's speed, is under test."""
    assert next(model.parameters()).dtype == formats.FORMATS[fmt]
    return CostModel(CURVES[fmt], context=64)


def test_a_model_agrees_with_itself_completely(target, tokenizer):
    texts = random_prompts(len(tokenizer), 4)
    agree = formats.agreement(target, target, texts)
    assert agree.top1 == 1.0 and agree.mean_abs_logprob_diff == 0.0
    assert agree.positions == sum(len(t) - 1 for t in texts)


def test_bf16_moves_the_log_probs_but_keeps_most_choices(target, tokenizer):
    agree = formats.agreement(target, formats.convert(target, "bfloat16"),
                              random_prompts(len(tokenizer), 8))
    assert 0.0 < agree.mean_abs_logprob_diff < 0.5
    assert agree.top1 > 0.8


def test_convert_leaves_the_reference_in_float32(target):
    copy = formats.convert(target, "bfloat16")
    assert next(copy.parameters()).dtype == torch.bfloat16
    assert next(target.parameters()).dtype == torch.float32


def test_the_faster_format_is_chosen_when_it_agrees(target, tokenizer):
    texts = random_prompts(len(tokenizer), 4)
    model, fmt, results = formats.choose(target, ["float32", "bfloat16"], synthetic, texts,
                                         "ngram", 3, min_agreement=0.5, progress=lambda m: None)
    assert fmt == "bfloat16" and next(model.parameters()).dtype == torch.bfloat16
    assert [r.eligible for r in results] == [True, True]


def test_a_format_below_the_agreement_bound_is_never_chosen(target, tokenizer):
    texts = random_prompts(len(tokenizer), 4)
    said = []
    model, fmt, results = formats.choose(target, ["float32", "bfloat16"], synthetic, texts,
                                         "ngram", 3, min_agreement=1.01, progress=said.append)
    assert fmt == "float32" and model is target
    assert not results[1].eligible and "not used" in said[1]


@pytest.mark.parametrize("method,fmt", [("off", "float32"), ("ngram", "bfloat16")])
def test_the_configured_methods_predicted_rate_decides(method, fmt, target, tokenizer):
    _, chosen, _ = formats.choose(target, ["float32", "bfloat16"], synthetic,
                                  random_prompts(len(tokenizer), 2), method, 3, 0.0,
                                  progress=lambda m: None)
    assert chosen == fmt
