"""The sampling transform, applied identically to the target (p) and the draft (q).

Speculative sampling is lossless with respect to the distribution both sides are sampled from, so
temperature, top-k and top-p must shape p and q the same way (Leviathan et al. 2023, section 3.1:
any transform of the logits works as long as it is applied to both models).
"""

from __future__ import annotations

from typing import Protocol

import torch


class SamplingParams(Protocol):
    """What the transform reads; `config.SamplingConfig` satisfies it."""

    temperature: float
    top_k: int
    top_p: float


def is_greedy(sampling: SamplingParams) -> bool:
    return sampling.temperature <= 0.0


def logits_to_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """logits: [n, vocab] -> probabilities [n, vocab] in float32.

    Temperature 0 gives a one-hot on the argmax, so greedy decoding is the limit of sampling.
    """
    assert logits.ndim == 2
    logits = logits.float()
    if is_greedy(sampling):
        probs = torch.zeros_like(logits)
        return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits / sampling.temperature
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        logits = _top_p_filter(logits, sampling.top_p)
    return torch.softmax(logits, dim=-1)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    # logits: [n, vocab]. Keep the smallest set of most likely tokens whose mass reaches top_p.
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [n, vocab]
    drop_sorted = mass_before >= top_p  # the most likely token always has 0 before it: kept
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """One generator per request: a fixed seed reproduces the run, None draws a fresh seed."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs: [n, vocab] -> token ids [n], on the probs' device (no host sync)."""
    assert probs.ndim == 2
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
