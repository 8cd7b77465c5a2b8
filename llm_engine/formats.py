"""Weight formats of the target: what each costs here and what it changes in the output.

A format is part of the measured pair (quantising the drafter or target changes the pair), so
picking one takes measurements on the machine at hand, never a table:
- speed: the runner's cost model in that format (`llm_engine.cost_model`);
- quality: teacher-forced top-1 agreement with the fp32 reference, and the mean absolute
  difference of the log-probability of each next token, over held-out text;
- losslessness: whether the runner's logits for a position are bit-identical whatever the
  forward's row count (`llm_engine.lean.runner.probe_invariance`); a format where they are not
  would let speculation change the reply, so it is never chosen automatically.
Formats: float32, bfloat16 and float16 weights, and the lean runner's weight-only int8 and q4
(`llm_engine.lean`), which stream 4x and 8x fewer bytes per token than fp32. `choose` keeps the
fastest eligible one; the caller caches the choice per machine, so every process runs the same.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from llm_engine.cost_model import CostModel, expected_tokens
from llm_engine.runner import TargetRunner

FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALL_FORMATS = (*FORMATS, "int8", "q4")
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
    tokens_per_s: float  # predicted by `rate`
    agreement: Agreement | None  # None for the fp32 reference itself
    eligible: bool
    bit_identical: bool | None = None  # a row's logits independent of the row count; None: eager

    @classmethod
    def from_dict(cls, data: dict) -> FormatResult:
        agree = data.get("agreement")
        return cls(**{**data, "agreement": Agreement(**agree) if agree else None})

    def to_dict(self) -> dict:
        return asdict(self)


def convert(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """A copy of the model in another format (the original is kept as the reference)."""
    return copy.deepcopy(model).to(FORMATS[fmt])


@torch.inference_mode()
def agreement(reference: TargetRunner, candidate: TargetRunner,
              texts: list[list[int]]) -> Agreement:
    """Teacher-forced: both runners read the same token ids; compare their next-token choices."""
    same = total = 0
    diff = 0.0
    for ids in texts:
        if len(ids) < 2:
            continue
        ref = _log_probs(reference, ids)  # [n, vocab]
        cand = _log_probs(candidate, ids).to(ref.device)
        same += int((ref[:-1].argmax(-1) == cand[:-1].argmax(-1)).sum())
        following = torch.tensor(ids[1:], device=ref.device).unsqueeze(-1)  # [n - 1, 1]
        diff += float((ref[:-1].gather(1, following) - cand[:-1].gather(1, following)).abs().sum())
        total += len(ids) - 1
    if not total:
        raise ValueError("agreement needs at least one text of two tokens or more")
    return Agreement(same / total, diff / total, total)


def rate(costs: CostModel, max_k: int) -> float:
    """Predicted tokens per second of a step over this cost model's verify curve, at the best
    draft length for REFERENCE_ACCEPTANCE (k = 0: plain decoding). It leaves out any method's
    drafting cost on purpose: the choice must not depend on the method configured, so that
    processes running different methods run the same format and say the same words."""
    k = costs.best_k("", REFERENCE_ACCEPTANCE, max_k)
    return 1000.0 * expected_tokens(k, REFERENCE_ACCEPTANCE) / costs.step_ms("", k)


def choose(
    candidates: list[str],
    build: Callable[[str], TargetRunner],
    measure: Callable[[dict[str, TargetRunner]], dict[str, CostModel]],
    reference: TargetRunner,
    texts: list[list[int]],
    max_k: int,
    min_agreement: float,
    progress: Callable[[str], None] = print,
) -> tuple[TargetRunner, str, list[FormatResult]]:
    """The fastest eligible format and every candidate's figures.

    `build(format)` makes the target's runner in that format (`reference` for float32, which is
    always eligible); `measure(runners)` returns each one's cost model, measured side by side
    (one at a time, a load that comes and goes would decide the choice).
    """
    runners = {fmt: reference if fmt == "float32" else build(fmt) for fmt in candidates}
    costs = measure(runners)
    results: list[FormatResult] = []
    best: tuple[float, TargetRunner, str] | None = None
    for fmt, runner in runners.items():
        agree = None if runner is reference else agreement(reference, runner, texts)
        identical = getattr(runner, "bit_identical", None)
        eligible = (agree is None or agree.top1 >= min_agreement) and identical is not False
        result = FormatResult(fmt, costs[fmt].plain_ms, rate(costs[fmt], max_k), agree, eligible,
                              identical)
        results.append(result)
        progress(_describe(result, min_agreement))
        if eligible and (best is None or result.tokens_per_s > best[0]):
            best = (result.tokens_per_s, runner, fmt)
    if best is None:
        raise ValueError("no format is eligible; float32, the reference, must be a candidate")
    return best[1], best[2], results


def _log_probs(runner: TargetRunner, ids: list[int]) -> torch.Tensor:
    out = runner.forward(runner.new_cache(), torch.tensor([ids], device=runner.device))
    return torch.log_softmax(out.logits.float(), dim=-1)


def _describe(result: FormatResult, bound: float) -> str:
    text = f"format {result.format}: plain step {result.plain_ms:.1f} ms, " \
           f"{result.tokens_per_s:.1f} tok/s predicted"
    if result.agreement is not None:
        verdict = "" if result.eligible else (
            " (not bit-identical across row counts: not used)" if result.bit_identical is False
            else f" (below the {bound:.2f} bound: not used)")
        text += f", top-1 agreement with fp32 {result.agreement.top1:.3f}{verdict}"
    return text
