"""The sampling transform, applied identically to the target (p) and the draft (q), and the
sources of randomness.

Speculative sampling is lossless with respect to the distribution both sides are sampled from, so
temperature, top-k and top-p must shape p and q the same way (Leviathan et al. 2023, section 3.1:
any transform of the logits works as long as it is applied to both models).

Two sources of randomness, both derived from the request's seed:
- the request generator (`make_generator`), one stream drawn in step order: the draft model samples
  its drafts from it and `verify.verify_sampling` its uniforms and resamples;
- per-position Gumbel noise (`gumbel_noise`), a pure function of (seed, absolute position), for
  `verify.verify_gumbel`: what position j samples cannot depend on how earlier steps were cut.
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


def gumbel_noise(
    base_seed: int, first_position: int, n: int, vocab: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Gumbel(0, 1) noise [n, vocab]; row i belongs to absolute position first_position + i.

    Each position gets a fresh generator seeded by `position_seed(base_seed, position)`, so row i
    is the same whichever step, draft length or gate state asks for it. The cost is one uniform
    draw over the vocabulary per row: ~0.2 ms for SmolLM2's 49k on the CPU, less than the 0.8 ms
    multinomial a plain sampled step used before.
    """
    rows = []
    for position in range(first_position, first_position + n):
        generator = torch.Generator(device=device)
        generator.manual_seed(position_seed(base_seed, position))
        rows.append(torch.rand(vocab, device=device, generator=generator))  # [vocab], in [0, 1)
    u = torch.stack(rows).clamp_(min=torch.finfo(torch.float32).tiny)  # [n, vocab], log(0) guard
    return -torch.log(-torch.log(u))


_MASK64 = (1 << 64) - 1


def position_seed(base_seed: int, position: int) -> int:
    """A 64-bit seed for one position: SplitMix64's finaliser over (seed, position).

    Neighbouring positions and neighbouring request seeds get unrelated generator states (a plain
    seed + position would make request seed s at position j + 1 replay seed s + 1 at j).
    """
    x = (base_seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs: [n, vocab] -> token ids [n], on the probs' device (no host sync)."""
    assert probs.ndim == 2
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
