"""Verification of drafted tokens: pure functions over tensors, no model and no cache.

Implements speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling").

Vocabulary, used with these names throughout the package:
- p: the target model's probabilities, one row per position, [k + 1, vocab].
- q: the draft's (proposer's) probabilities for the drafted tokens, [k, vocab].
- draft tokens d_0 .. d_{k-1}: what the proposer guessed for the next k positions.
- accepted tokens: the longest prefix of the draft that the target keeps.
- recovered token: at the first rejected position, a token drawn from the target instead
  (greedy: the target's argmax; sampling: the normalised residual max(0, p - q)).
- bonus token: when all k draft tokens are accepted, one more token from p[k], for free.
Every step therefore commits num_accepted + 1 tokens. An empty draft (k = 0) is plain decoding.

Two sampled verifications, differing only in where their randomness comes from:
- `verify_sampling`, the papers' rule, for drafts that carry q (the draft model). Its uniforms and
  resamples come from the request generator in step order, so which tokens a seed produces
  depends on how many tokens each step drafted.
- `verify_gumbel`, for drafts without q (n-gram lookups are one-hot, q = 1 on the draft token x)
  and for plain steps. Position j owns Gumbel noise G_j, fixed by (request seed, j)
  (`sampling.gumbel_noise`), and the target's sample there is t_j = argmax(log p_j + G_j), which
  is distributed exactly as p_j (the Gumbel-max trick). A draft token is accepted while it equals
  t_j; the first mismatch commits t_j as the recovered token, a fully accepted draft commits t_k
  as the bonus: `verify_greedy` on log p + G. This IS rejection sampling for a one-hot q:
  P(accept x) = P(t_j = x) = p(x) = min(1, p(x) / q(x)), and on rejection t_j is p conditioned on
  t_j != x, i.e. p(y) / (1 - p(x)) for y != x: the normalised max(0, p - q), exactly the rule.
  Only the randomness is coupled to the position instead of the step. Each committed token is
  t_j given the committed prefix, and G_j decides nothing before position j is committed (rows
  past a mismatch are discarded unread), so the tokens are those plain decoding with the same seed
  produces, whatever K and the cost gate did: the gate may stay on for seeded requests.

Constrained requests (`llm_engine.grammar`): each verified row's logits are masked with
`mask_logits` before p is formed, and model drafts are sampled from q masked the same way. Both
rules above are lossless for any p and q, so the committed tokens follow the masked target.
History penalties (`llm_engine.sampling.penalize`) shape each row the same way before p is formed,
row i with the history up to draft token i, and model drafts' q with the same history.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class VerifyResult:
    tokens: list[int]  # committed: the accepted draft prefix, then the recovered or bonus token
    num_accepted: int  # how many draft tokens were kept
    rejection_pos: int | None  # index of the first rejected draft token; None when all accepted


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax as an int: the first of equal maxima, a NaN before any number (torch's
    rule, and numpy's). A CPU's float32 rows go through numpy, whose vectorised argmax took 5.5
    us over a 49152-token row against torch's 66 (Intel Xeon, 2026-12-07): once a row a step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return np.argmax(logits.detach().numpy(), axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Exact match against the target's argmax.

    draft_tokens: [k]; target_logits: [k + 1, vocab], row i scores the position of draft token i
    (row k scores the position after the whole draft).
    """
    assert draft_tokens.ndim == 1 and target_logits.ndim == 2
    k = draft_tokens.shape[0]
    assert target_logits.shape[0] == k + 1
    # One host sync for the target's choices; comparing at most a few ints in Python is cheaper
    # than a second device round trip.
    target_tokens = argmax_rows(target_logits)  # [k + 1]
    draft = draft_tokens.tolist()
    n = 0
    while n < k and draft[n] == target_tokens[n]:
        n += 1
    # The accepted draft equals the target's own choices, so the committed tokens are simply the
    # target's argmax up to and including the recovered (n < k) or bonus (n == k) position.
    return VerifyResult(target_tokens[: n + 1], n, None if n == k else n)


def verify_sampling(
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Rejection sampling: keep d_i with probability min(1, p_i(d_i) / q_i(d_i)).

    draft_tokens: [k]; q: [k, vocab] or None for a deterministic proposer (q is then one-hot on
    the draft token, the standard choice for n-gram drafts); p: [k + 1, vocab].
    The committed tokens are distributed exactly as sampling from p one token at a time.
    """
    assert draft_tokens.ndim == 1 and p.ndim == 2
    k = draft_tokens.shape[0]
    assert p.shape[0] == k + 1
    if k == 0:
        return VerifyResult([_sample(p[0], generator)], 0, None)

    draft = draft_tokens.to(p.device)
    rows = torch.arange(k, device=p.device)
    p_d = p[rows, draft]  # [k] target probability of each draft token
    q_d = torch.ones_like(p_d) if q is None else q[rows, draft]  # [k]
    u = torch.rand(k, device=p.device, generator=generator)  # [k], in [0, 1)
    # u < p/q without the division: a zero q_d then accepts iff p_d > 0, as min(1, p/q) does.
    accepted = (u * q_d < p_d).tolist()
    n = accepted.index(False) if False in accepted else k
    tokens = draft_tokens[:n].tolist()
    if n == k:
        tokens.append(_sample(p[k], generator))
        return VerifyResult(tokens, k, None)
    q_row = _one_hot(draft_tokens[n], p.shape[1], p) if q is None else q[n]
    tokens.append(_sample(residual_distribution(p[n], q_row), generator))
    return VerifyResult(tokens, n, n)


def verify_gumbel(
    draft_tokens: torch.Tensor, p: torch.Tensor, gumbel: torch.Tensor
) -> VerifyResult:
    """Rejection sampling for a one-hot q, with per-position Gumbel noise (see the module doc).

    draft_tokens: [k]; p: [k + 1, vocab]; gumbel: [k + 1, vocab], row i the noise of the absolute
    position that p's row i scores.
    """
    assert draft_tokens.ndim == 1 and p.ndim == 2 and gumbel.shape == p.shape
    # log 0 = -inf keeps tokens removed by top-k / top-p out of the argmax.
    return verify_greedy(draft_tokens, torch.log(p) + gumbel)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [..., vocab] with -inf where `allowed` (bool, same shape) is False."""
    return logits.masked_fill(~allowed, float("-inf"))


def residual_distribution(p_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
    """Normalised max(0, p - q) over [vocab]; p itself when the residual has no mass.

    The residual is zero only when p == q up to rounding, where a rejection is a float artefact;
    sampling from p is then the exact answer.
    """
    assert p_row.ndim == 1 and q_row.ndim == 1
    residual = torch.clamp(p_row - q_row, min=0.0)
    total = residual.sum()
    if total.item() <= 1e-12:
        return p_row
    return residual / total


def clip_committed(
    tokens: list[int], eos_token_ids: Collection[int], budget: int
) -> tuple[list[int], str | None]:
    """Cut committed tokens at the first EOS (kept) or at the token budget.

    Returns the tokens to emit and the finish reason ('eos' | 'length'), or None to continue.
    EOS can land inside an accepted draft: everything after it is dropped.
    """
    for i, token in enumerate(tokens[:budget]):
        if token in eos_token_ids:
            return tokens[: i + 1], "eos"
    if len(tokens) >= budget:
        return tokens[:budget], "length"
    return tokens, None


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    # probs: [vocab]
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _one_hot(token: torch.Tensor, vocab: int, like: torch.Tensor) -> torch.Tensor:
    row = torch.zeros(vocab, dtype=like.dtype, device=like.device)  # [vocab]
    row[token.to(like.device)] = 1.0
    return row
