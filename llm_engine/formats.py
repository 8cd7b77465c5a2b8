"""Weight formats of the target: what each costs here and what it changes in the output.

A format is part of the measured pair (seed 001: quantising the drafter or target changes the
pair), so picking one takes two measurements on the machine at hand, never a table:
- speed: the runner's cost model in that format (`llm_engine.cost_model`);
- quality: teacher-forced top-1 agreement with the fp32 reference, and the mean absolute
  difference of the log-probability of each next token, over held-out text.
bf16 halves the bytes a CPU streams per step and, where the CPU has bf16 dot products (AVX512-BF16,
AMX), verifies many rows for little more than one; elsewhere it loses to fp32. `choose` keeps the
fastest format whose agreement clears the bound.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from llm_engine import kv
from llm_engine.cost_model import CostModel, expected_tokens

FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The acceptance at which formats are compared for a speculative method: a conversation's.
REFERENCE_ACCEPTANCE = 0.5


@dataclass
class Agreement:
    top1: float  # share of positions where both formats' argmax agree
    mean_abs_logprob_diff: float  # mean |log p(next) - log p_ref(next)| over the text's tokens
    positions: int


@dataclass
class FormatResult:
    format: str
    plain_ms: float
    tokens_per_s: float  # predicted for the configured method at REFERENCE_ACCEPTANCE
    agreement: Agreement | None  # None for the fp32 reference itself
    eligible: bool

    def to_dict(self) -> dict:
        return asdict(self)


def convert(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """A copy of the model in another format (the original is kept as the reference)."""
    return copy.deepcopy(model).to(FORMATS[fmt])


@torch.inference_mode()
def agreement(reference: torch.nn.Module, candidate: torch.nn.Module,
              texts: list[list[int]]) -> Agreement:
    """Teacher-forced: both models read the same token ids; compare their next-token choices."""
    same = total = 0
    diff = 0.0
    for ids in texts:
        if len(ids) < 2:
            continue
        tokens = torch.tensor([ids], device=next(reference.parameters()).device)
        ref = _log_probs(reference, tokens)  # [n, vocab]
        cand = _log_probs(candidate, tokens.to(next(candidate.parameters()).device)).to(ref.device)
        same += int((ref[:-1].argmax(-1) == cand[:-1].argmax(-1)).sum())
        following = tokens[0, 1:].unsqueeze(-1).to(ref.device)  # [n - 1, 1]
        diff += float((ref[:-1].gather(1, following) - cand[:-1].gather(1, following)).abs().sum())
        total += len(ids) - 1
    if not total:
        raise ValueError("agreement needs at least one text of two tokens or more")
    return Agreement(same / total, diff / total, total)


def rate(costs: CostModel, method: str, max_k: int) -> float:
    """Predicted tokens per second of `method` with this cost model."""
    if method == "off":
        return 1000.0 / costs.plain_ms
    k = costs.best_k(method, REFERENCE_ACCEPTANCE, max_k)
    return 1000.0 * expected_tokens(k, REFERENCE_ACCEPTANCE) / costs.step_ms(method, k)


def choose(
    model: torch.nn.Module,
    candidates: list[str],
    measure: Callable[[torch.nn.Module, str], CostModel],
    texts: list[list[int]],
    method: str,
    max_k: int,
    min_agreement: float,
    progress: Callable[[str], None] = print,
) -> tuple[torch.nn.Module, str, list[FormatResult]]:
    """The fastest eligible format of `model` (given in float32) and every candidate's figures.

    `measure(model, format)` returns that format's cost model (cached by the caller).
    """
    results: list[FormatResult] = []
    best: tuple[float, torch.nn.Module, str] | None = None
    for fmt in candidates:
        candidate = model if fmt == "float32" else convert(model, fmt)
        costs = measure(candidate, fmt)
        agree = None if candidate is model else agreement(model, candidate, texts)
        eligible = agree is None or agree.top1 >= min_agreement
        result = FormatResult(fmt, costs.plain_ms, rate(costs, method, max_k), agree, eligible)
        results.append(result)
        progress(_describe(result, min_agreement))
        if eligible and (best is None or result.tokens_per_s > best[0]):
            best = (result.tokens_per_s, candidate, fmt)
    assert best is not None, "float32 is always eligible"
    return best[1], best[2], results


def _log_probs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = kv.forward(model, tokens, kv.new_cache(model))  # [n, vocab]
    return torch.log_softmax(logits.float(), dim=-1)


def _describe(result: FormatResult, bound: float) -> str:
    text = f"format {result.format}: plain step {result.plain_ms:.1f} ms, " \
           f"{result.tokens_per_s:.1f} tok/s predicted"
    if result.agreement is not None:
        verdict = "" if result.eligible else f" (below the {bound:.2f} bound: not used)"
        text += f", top-1 agreement with fp32 {result.agreement.top1:.3f}{verdict}"
    return text
