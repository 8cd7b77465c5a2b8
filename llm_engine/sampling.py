"""The sampling transform, applied identically to the target (p) and the draft (q), the
history penalties, and the sources of randomness.

Speculative sampling is lossless with respect to the distribution both sides are sampled from, so
temperature, top-k and top-p must shape p and q the same way (Leviathan et al. 2023, section 3.1:
any transform of the logits works as long as it is applied to both models).

The history penalties (`penalize`: a repetition penalty, no-repeat n-grams) also read the tokens
before the position scored. Row i of a verify forward scores the position after the committed
tokens and draft tokens d_0 .. d_{i-1}, so it is penalised with that history, exactly what plain
decoding would have seen there had those drafts been committed; a model draft's position i is
penalised with the same history before it is sampled. The processed rows are then a pure function
of (logits, history), the same on both sides, and speculation stays exact for the penalised target.

Two sources of randomness, both derived from the request's seed:
- the request generator (`make_generator`), one stream drawn in step order: the draft model samples
  its drafts from it and `verify.verify_sampling` its uniforms and resamples;
- per-position Gumbel noise (`gumbel_noise`), a pure function of (seed, absolute position), for
  `verify.verify_gumbel`: what position j samples cannot depend on how earlier steps were cut.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import torch


class SamplingParams(Protocol):
    """What the transform reads; `config.SamplingConfig` satisfies it."""

    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    no_repeat_ngram_size: int
    penalty_last_n: int


def is_greedy(sampling: SamplingParams) -> bool:
    return sampling.temperature <= 0.0


def uses_history(sampling: SamplingParams) -> bool:
    """Whether `penalize` changes anything: a penalty other than 1 or an n-gram ban."""
    return sampling.repetition_penalty != 1.0 or sampling.no_repeat_ngram_size > 0


def penalize(
    logits: torch.Tensor,
    history: Sequence[int],
    drafts: Sequence[int],
    sampling: SamplingParams,
    exempt: Collection[int] = (),
) -> torch.Tensor:
    """logits [n, vocab] -> penalised logits [n, vocab] (float32; the input when nothing applies).

    Row i scores the token after `history` + `drafts[:i]`; its window is the last
    `penalty_last_n` tokens of that sequence (0: all of it). Transformers' semantics:
    - repetition penalty r (RepetitionPenaltyLogitsProcessor): the logit of every token in the
      window is divided by r when positive, multiplied by r when negative;
    - no-repeat n-grams of size n (NoRepeatNGramLogitsProcessor): a token that would complete an
      n-gram already in the window is banned (-inf). A ban that would leave a row nothing (a
      grammar allowing only repeated text) is skipped for that row, never an empty distribution.
    `exempt` tokens (the engine passes EOS) are never penalised: every chat message ends in EOS,
    so a penalised EOS would lengthen every reply.
    """
    assert logits.ndim == 2
    if not uses_history(sampling):
        return logits
    n = logits.shape[0]
    last_n = sampling.penalty_last_n or len(history) + n
    tail = list(history[-last_n:])
    seq = torch.tensor([*tail, *drafts[: n - 1]], dtype=torch.long, device=logits.device)
    out = logits.float().clone()
    for i in range(n):
        end = len(tail) + i
        window = seq[max(0, end - last_n) : end]  # row i's history, at most last_n tokens
        _penalize_row(out[i], window, sampling)
    if exempt:
        ids = torch.tensor(sorted(exempt), dtype=torch.long, device=logits.device)
        out[:, ids] = logits[:, ids].float()
    return out


def _penalize_row(row: torch.Tensor, window: torch.Tensor, sampling: SamplingParams) -> None:
    # row: [vocab], changed in place; window: [m] token ids. Duplicate ids write equal values.
    penalty = sampling.repetition_penalty
    if penalty != 1.0 and window.numel():
        seen = row[window]
        row[window] = torch.where(seen > 0, seen / penalty, seen * penalty)
    size = sampling.no_repeat_ngram_size
    if size > 0 and window.numel() >= size:
        ngrams = window.unfold(0, size, 1)  # [m - size + 1, size]
        prefix = window[window.numel() - size + 1 :]  # [size - 1], the last tokens
        banned = ngrams[(ngrams[:, :-1] == prefix).all(dim=1), -1]
        if banned.numel():
            kept = row.index_fill(0, banned, float("-inf"))
            if torch.isfinite(kept).any():
                row.copy_(kept)


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
