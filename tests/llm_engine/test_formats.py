"""Weight formats: agreement with fp32 and the measured choice, on tiny random models."""

from __future__ import annotations

import pytest
import torch

from llm_engine import formats
from llm_engine.cost_model import CostModel
from llm_engine.lean.runner import LeanRunner
from llm_engine.runner import EagerRunner
from tests.llm_engine.test_engine import random_prompts

# fp32: the cheaper plain step; bf16: a flat verify curve, where speculation pays.
CURVES = {"float32": [30.0, 90.0, 100.0, 80.0], "bfloat16": [40.0, 42.0, 44.0, 45.0],
          "q4": [26.0, 60.0, 70.0, 80.0]}


def synthetic(runners: dict) -> dict[str, CostModel]:
    """Stand-in measurements: the choice logic, not this machine's speed, is under test."""
    assert all(runner.format == fmt for fmt, runner in runners.items())
    return {fmt: CostModel(CURVES[fmt], context=64) for fmt in runners}


def build(target):
    return lambda fmt: EagerRunner(formats.convert(target, fmt)) if fmt in formats.FORMATS \
        else LeanRunner(target, fmt, 128, 4)


def choose(target, tokenizer, candidates, min_agreement=0.5, said=None):
    return formats.choose(candidates, build(target), synthetic, EagerRunner(target),
                          random_prompts(len(tokenizer), 4), 3, min_agreement,
                          progress=(said.append if said is not None else lambda m: None))


def test_a_model_agrees_with_itself_completely(target, tokenizer):
    texts = random_prompts(len(tokenizer), 4)
    agree = formats.agreement(EagerRunner(target), EagerRunner(target), texts)
    assert agree.top1 == 1.0 and agree.mean_abs_logprob_diff == 0.0
    assert agree.positions == sum(len(t) - 1 for t in texts)


@pytest.mark.parametrize("fmt", ["bfloat16", "q4"])
def test_a_format_moves_the_log_probs_but_keeps_most_choices(target, tokenizer, fmt):
    agree = formats.agreement(EagerRunner(target), build(target)(fmt),
                              random_prompts(len(tokenizer), 8))
    assert 0.0 < agree.mean_abs_logprob_diff < 0.5
    assert agree.top1 > 0.8


def test_convert_leaves_the_reference_in_float32(target):
    copy = formats.convert(target, "bfloat16")
    assert next(copy.parameters()).dtype == torch.bfloat16
    assert next(target.parameters()).dtype == torch.float32


def test_the_fastest_eligible_format_is_chosen(target, tokenizer):
    runner, fmt, results = choose(target, tokenizer, ["float32", "bfloat16", "q4"])
    assert fmt == "bfloat16" and runner.format == "bfloat16"  # the flat curve: most tok/s
    assert [r.eligible for r in results] == [True, True, True]
    assert results[2].bit_identical is True


def test_a_format_below_the_agreement_bound_is_never_chosen(target, tokenizer):
    said = []
    runner, fmt, results = choose(target, tokenizer, ["float32", "bfloat16"], 1.01, said)
    assert fmt == "float32" and runner.model is target
    assert not results[1].eligible and "not used" in said[1]


def test_a_format_whose_rows_are_not_bit_identical_is_never_chosen(target, tokenizer):
    def flaky(fmt):
        runner = LeanRunner(target, fmt, 128, 4)
        runner.bit_identical = False
        return runner

    said = []
    _, fmt, results = formats.choose(["float32", "q4"], flaky, synthetic, EagerRunner(target),
                                     random_prompts(len(tokenizer), 2), 3, 0.0, said.append)
    assert fmt == "float32" and not results[1].eligible
    assert "not bit-identical" in said[1]


def test_the_choice_does_not_depend_on_the_configured_method():
    """The rate reads the verify curve only: `off` and `ngram` processes pick the same format."""
    costs = CostModel(CURVES["bfloat16"], context=64)
    assert formats.rate(costs, 3) > 1000.0 / costs.plain_ms  # speculation's curve counts


def test_a_format_result_survives_its_json_round_trip(target, tokenizer):
    _, _, results = choose(target, tokenizer, ["float32", "q4"])
    assert [formats.FormatResult.from_dict(r.to_dict()) for r in results] == results
