"""The verify functions on hand-built logits and probabilities (no model)."""

from __future__ import annotations

import torch

from llm_engine.sampling import gumbel_noise
from llm_engine.verify import (
    VerifyResult,
    argmax_rows,
    clip_committed,
    mask_logits,
    residual_distribution,
    verify_greedy,
    verify_gumbel,
    verify_sampling,
)

VOCAB = 8
EOS = 7


def greedy_logits(choices: list[int]) -> torch.Tensor:
    """[len(choices), VOCAB] logits whose argmax at row i is choices[i]."""
    logits = torch.zeros(len(choices), VOCAB)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


# -- greedy ---------------------------------------------------------------------------------------


def test_argmax_rows_picks_as_torch_does_ties_nan_and_infinities():
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, nan, 3.0, nan], [-inf] * 4, [2.0, 5.0, 5.0, 1.0],
                         [inf, nan, inf, 1.0], [0.5, -1.0, 7.0, 7.0]])
    wide = torch.randn(3, 49152)
    for logits in (rows, wide, wide[:, ::2], wide.bfloat16()):
        assert argmax_rows(logits) == logits.argmax(dim=-1).tolist()


def test_greedy_all_accepted_adds_bonus_token():
    result = verify_greedy(torch.tensor([3, 1, 4]), greedy_logits([3, 1, 4, 6]))
    assert result.tokens == [3, 1, 4, 6]
    assert result.num_accepted == 3
    assert result.rejection_pos is None


def test_greedy_first_token_rejected_gives_target_token():
    result = verify_greedy(torch.tensor([2, 1, 4]), greedy_logits([5, 1, 4, 6]))
    assert result.tokens == [5]
    assert result.num_accepted == 0
    assert result.rejection_pos == 0


def test_greedy_mismatch_in_the_middle_keeps_prefix_then_recovers():
    result = verify_greedy(torch.tensor([3, 1, 4]), greedy_logits([3, 2, 4, 6]))
    assert result.tokens == [3, 2]
    assert result.num_accepted == 1
    assert result.rejection_pos == 1


def test_greedy_empty_draft_is_plain_decoding():
    result = verify_greedy(torch.empty(0, dtype=torch.long), greedy_logits([6]))
    assert result.tokens == [6]
    assert result.num_accepted == 0
    assert result.rejection_pos is None


def test_greedy_eos_inside_accepted_draft_is_cut_there():
    result = verify_greedy(torch.tensor([3, EOS, 4]), greedy_logits([3, EOS, 4, 6]))
    assert result.tokens == [3, EOS, 4, 6]  # verify itself knows nothing about EOS
    tokens, reason = clip_committed(result.tokens, {EOS}, budget=10)
    assert tokens == [3, EOS]
    assert reason == "eos"


def test_clip_committed_never_exceeds_budget():
    assert clip_committed([1, 2, 3, 4], {EOS}, budget=2) == ([1, 2], "length")
    assert clip_committed([1, 2], {EOS}, budget=2) == ([1, 2], "length")
    assert clip_committed([1, 2], {EOS}, budget=5) == ([1, 2], None)


def test_clip_committed_eos_at_the_budget_edge_reports_eos():
    assert clip_committed([1, EOS, 3], {EOS}, budget=2) == ([1, EOS], "eos")


# -- sampling: single cases -----------------------------------------------------------------------


def test_sampling_empty_draft_samples_from_p0():
    p = torch.zeros(1, VOCAB)
    p[0, 4] = 1.0
    result = verify_sampling(torch.empty(0, dtype=torch.long), None, p, torch.Generator())
    assert result.tokens == [4]
    assert result.rejection_pos is None


def test_sampling_draft_with_zero_target_probability_is_always_rejected():
    p = torch.full((2, VOCAB), 1.0 / (VOCAB - 1))
    p[0, 3] = 0.0
    q = torch.zeros(1, VOCAB)
    q[0, 3] = 1.0
    for seed in range(20):
        result = verify_sampling(torch.tensor([3]), q, p, torch.Generator().manual_seed(seed))
        assert result.rejection_pos == 0
        assert result.tokens[0] != 3


def test_sampling_draft_that_equals_target_is_always_accepted():
    p = torch.softmax(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)), -1)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        draft = torch.multinomial(p[:3], 1, generator=gen).squeeze(-1)
        result = verify_sampling(draft, p[:3], p, gen)
        assert result.num_accepted == 3
        assert len(result.tokens) == 4


def test_residual_without_mass_falls_back_to_p():
    p_row = torch.tensor([0.5, 0.5, 0.0, 0.0])
    assert torch.equal(residual_distribution(p_row, p_row.clone()), p_row)


def test_residual_is_normalised_positive_part():
    p_row = torch.tensor([0.6, 0.2, 0.2, 0.0])
    q_row = torch.tensor([0.2, 0.4, 0.2, 0.2])
    assert torch.allclose(residual_distribution(p_row, q_row), torch.tensor([1.0, 0, 0, 0]))


def test_sampling_same_seed_same_tokens():
    p = torch.softmax(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)), -1)
    q = torch.softmax(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)), -1)
    draft = torch.tensor([1, 2, 3])
    runs = [
        [verify_sampling(draft, q, p, g).tokens for _ in range(30)]
        for g in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))
    ]
    assert runs[0] == runs[1]


# -- sampling with per-position Gumbel noise: single cases ----------------------------------------


def test_gumbel_accepts_the_draft_while_it_equals_the_noisy_argmax():
    p = torch.softmax(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)), -1)
    noise = gumbel_noise(11, 0, 4, VOCAB)  # [4, VOCAB]
    chosen = (torch.log(p) + noise).argmax(-1).tolist()  # the target's sample at each position
    assert verify_gumbel(torch.tensor(chosen[:3]), p, noise).tokens == chosen
    wrong = (chosen[1] + 1) % VOCAB
    result = verify_gumbel(torch.tensor([chosen[0], wrong, chosen[2]]), p, noise)
    assert result.tokens == chosen[:2]  # the recovered token is the target's own sample there
    assert result.rejection_pos == 1


def test_gumbel_never_accepts_a_token_outside_top_k_or_top_p():
    p = torch.full((2, VOCAB), 1.0 / (VOCAB - 1))
    p[0, 3] = 0.0  # removed by the sampling transform
    for seed in range(50):
        result = verify_gumbel(torch.tensor([3]), p, gumbel_noise(seed, 0, 2, VOCAB))
        assert result.rejection_pos == 0 and result.tokens[0] != 3


# -- sampling: the output follows the target distribution -----------------------------------------
#
# Each position j has a fixed target distribution P[j] and draft distribution Q[j] (a "model"
# whose next-token distribution does not depend on the context), so sequences sampled through
# speculative steps must have the product distribution P[0] x P[1] x P[2]. The check compares the
# empirical joint distribution over all VOCAB_S ** LENGTH sequences with it in total variation.

VOCAB_S = 4
LENGTH = 3
SAMPLES = 20_000
# With 64 cells and 20k samples the expected TV of a correct sampler is about 0.02 (sum over
# cells of sqrt(2 p (1 - p) / (pi N)) / 2); 0.04 leaves room, the wrong samplers give >= 0.1.
TV_BOUND = 0.04
P = torch.tensor(
    [[0.50, 0.30, 0.15, 0.05], [0.10, 0.20, 0.30, 0.40], [0.25, 0.25, 0.25, 0.25]]
)  # [LENGTH, VOCAB_S]
Q = torch.tensor(
    [[0.25, 0.25, 0.25, 0.25], [0.40, 0.30, 0.20, 0.10], [0.70, 0.10, 0.10, 0.10]]
)  # [LENGTH, VOCAB_S]


def sample_sequences(sampler, seed: int = 0, p_all: torch.Tensor = P, q_all: torch.Tensor = Q,
                     drafts_from: torch.Tensor | None = None) -> torch.Tensor:
    """Counts [VOCAB_S ** LENGTH] of sequences made by draft-then-verify steps with `sampler`;
    drafts are drawn from `drafts_from` (default: the q the sampler is given)."""
    drafts_from = q_all if drafts_from is None else drafts_from
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB_S**LENGTH)
    for _ in range(SAMPLES):
        out: list[int] = []
        while len(out) < LENGTH:
            pos = len(out)
            k = LENGTH - 1 - pos  # draft every remaining position; the bonus covers the last
            q = q_all[pos : pos + k]  # [k, VOCAB_S]
            draft = (
                torch.multinomial(drafts_from[pos : pos + k], 1, generator=gen).squeeze(-1)
                if k
                else torch.empty(0, dtype=torch.long)
            )
            out += sampler(draft, q, p_all[pos : pos + k + 1], gen).tokens
        index = 0
        for token in out[:LENGTH]:
            index = index * VOCAB_S + token
        counts[index] += 1
    return counts


def target_joint(p: torch.Tensor = P) -> torch.Tensor:
    joint = p[0]
    for j in range(1, LENGTH):
        joint = torch.outer(joint, p[j]).flatten()
    return joint  # [VOCAB_S ** LENGTH]


def total_variation(counts: torch.Tensor, p: torch.Tensor = P) -> float:
    return 0.5 * (counts / counts.sum() - target_joint(p)).abs().sum().item()


def accept_always(draft, q, p, gen):
    """Wrong: keeps every draft token, so the output follows q."""
    tokens = draft.tolist() + [int(torch.multinomial(p[-1], 1, generator=gen))]
    return VerifyResult(tokens, len(draft), None)


def inverted_ratio(draft, q, p, gen):
    """Wrong: accepts with min(1, q/p) instead of min(1, p/q) (p and q swapped, as the other
    naming convention in gpt-fast and transformers makes easy to do)."""
    swapped = torch.cat([q, p[-1:]])  # the acceptance test now reads q where p belongs
    return verify_sampling(draft, p[:-1], swapped, gen)


def resample_from_p(draft, q, p, gen):
    """Wrong: on rejection draws from p instead of the residual max(0, p - q)."""
    result = verify_sampling(draft, q, p, gen)
    if result.rejection_pos is not None:
        n = result.rejection_pos
        result.tokens[n] = int(torch.multinomial(p[n], 1, generator=gen))
    return result


def test_speculative_sampling_follows_target_distribution():
    assert total_variation(sample_sequences(verify_sampling)) < TV_BOUND


def test_distribution_check_rejects_wrong_samplers():
    # The same check must fail for biased samplers, or passing it would prove nothing.
    for wrong in (accept_always, inverted_ratio, resample_from_p):
        tv = total_variation(sample_sequences(wrong, seed=1))
        assert tv > TV_BOUND, f"{wrong.__name__} passed the check (tv={tv:.3f})"


# -- the Gumbel path: one-hot drafts and plain steps with per-position noise -----------------------
#
# Same product distribution as above. Every sample is a request with its own seed; each step drafts
# a random number of one-hot tokens (random, so most are rejected and positions are re-scored by
# later steps). The noise functions below take (request seed, first absolute position, rows).


def noise_per_position(seed: int, first: int, rows: int) -> torch.Tensor:
    return gumbel_noise(seed, first, rows, VOCAB_S)


def noise_shared_by_positions(seed: int, first: int, rows: int) -> torch.Tensor:
    """Wrong: one G for every position, so the tokens of a sequence are correlated."""
    return gumbel_noise(seed, 0, 1, VOCAB_S).expand(rows, VOCAB_S)


def noise_per_step_row(seed: int, first: int, rows: int) -> torch.Tensor:
    """Wrong: noise indexed by the row within a step, so a step after a rejection reuses the G of
    positions that were already decided."""
    return gumbel_noise(seed, 0, rows, VOCAB_S)


def no_noise(seed: int, first: int, rows: int) -> torch.Tensor:
    """Wrong: log p alone, which is greedy decoding."""
    return torch.zeros(rows, VOCAB_S)


def sample_sequences_gumbel(noise, seed: int = 0, p_all: torch.Tensor = P) -> torch.Tensor:
    """Counts [VOCAB_S ** LENGTH] of sequences made by one-hot draft-then-verify steps."""
    gen = torch.Generator().manual_seed(seed)  # drafts and K only; never the target's randomness
    counts = torch.zeros(VOCAB_S**LENGTH)
    for request in range(SAMPLES):
        request_seed = seed * SAMPLES + request
        out: list[int] = []
        while len(out) < LENGTH:
            pos = len(out)
            k = int(torch.randint(0, LENGTH - pos, (1,), generator=gen))  # 0: a plain step
            draft = torch.randint(0, VOCAB_S, (k,), generator=gen)  # [k], one-hot drafts
            p = p_all[pos : pos + k + 1]  # [k + 1, VOCAB_S]
            out += verify_gumbel(draft, p, noise(request_seed, pos, k + 1)).tokens
        index = 0
        for token in out[:LENGTH]:
            index = index * VOCAB_S + token
        counts[index] += 1
    return counts


def test_gumbel_verification_follows_target_distribution():
    assert total_variation(sample_sequences_gumbel(noise_per_position)) < TV_BOUND


def test_distribution_check_rejects_wrong_gumbel_noise():
    for wrong in (noise_shared_by_positions, noise_per_step_row, no_noise):
        tv = total_variation(sample_sequences_gumbel(wrong, seed=1))
        assert tv > TV_BOUND, f"{wrong.__name__} passed the check (tv={tv:.3f})"


# -- a masked target: constrained decoding (llm_engine.grammar) ------------------------------------
#
# The engine masks each verified row's logits with the grammar's allowed tokens before forming p,
# and model drafts are sampled from q masked the same way; one-hot drafts may fall outside the mask.

MASK = torch.tensor(
    [[True, True, False, True], [False, True, True, False], [True, False, True, True]]
)  # [LENGTH, VOCAB_S]


def masked(probs: torch.Tensor) -> torch.Tensor:
    """probs [LENGTH, VOCAB_S] masked as the engine masks logits, renormalised."""
    return torch.softmax(mask_logits(probs.log(), MASK), dim=-1)


def test_speculative_sampling_follows_the_masked_target_distribution():
    p_masked, q_masked = masked(P), masked(Q)
    counts = sample_sequences(verify_sampling, p_all=p_masked, q_all=q_masked)
    assert total_variation(counts, p_masked) < TV_BOUND
    assert counts[target_joint(p_masked) == 0].sum() == 0  # never a token outside the mask


def test_gumbel_verification_follows_the_masked_target_distribution():
    p_masked = masked(P)
    counts = sample_sequences_gumbel(noise_per_position, p_all=p_masked)  # drafts ignore the mask
    assert total_variation(counts, p_masked) < TV_BOUND
    assert counts[target_joint(p_masked) == 0].sum() == 0


def test_distribution_check_rejects_a_mask_missing_on_either_side():
    p_masked, q_masked = masked(P), masked(Q)
    unmasked_target = sample_sequences(verify_sampling, seed=1, q_all=q_masked)
    # q masked for verification but the drafts drawn from the unmasked q.
    unmasked_drafts = sample_sequences(verify_sampling, seed=1, p_all=p_masked, q_all=q_masked,
                                       drafts_from=Q)
    for name, counts in (("unmasked target", unmasked_target),
                         ("unmasked drafts", unmasked_drafts)):
        tv = total_variation(counts, p_masked)
        assert tv > TV_BOUND, f"{name} passed the check (tv={tv:.3f})"
