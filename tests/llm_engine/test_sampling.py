"""The sampling transform shared by p and q, the per-request generator, the per-position noise."""

from __future__ import annotations

import torch

from llm_engine.config import SamplingConfig
from llm_engine.sampling import (
    gumbel_noise,
    logits_to_probs,
    make_generator,
    position_seed,
    sample,
)

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])  # [1, 5]


def test_temperature_zero_is_one_hot_on_argmax():
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=0.0))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]


def test_temperature_one_is_softmax():
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0))
    assert torch.allclose(probs, torch.softmax(LOGITS, -1))


def test_higher_temperature_flattens():
    cold = logits_to_probs(LOGITS, SamplingConfig(temperature=0.5))
    hot = logits_to_probs(LOGITS, SamplingConfig(temperature=2.0))
    assert cold[0, 0] > hot[0, 0]
    assert cold[0, -1] < hot[0, -1]


def test_top_k_keeps_k_most_likely():
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_k=2))
    assert (probs[0, 2:] == 0).all()
    assert torch.allclose(probs[0, :2], torch.softmax(LOGITS[0, :2], -1))


def test_top_p_keeps_smallest_set_reaching_p():
    full = torch.softmax(LOGITS, -1)[0]  # about [0.57, 0.21, 0.13, 0.08, 0.03]
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.7))
    kept = (probs[0] > 0).tolist()
    assert kept == [True, True, False, False, False]  # 0.57 < 0.7 <= 0.57 + 0.21
    assert torch.allclose(probs[0, :2], full[:2] / full[:2].sum())


def test_top_p_always_keeps_the_most_likely_token():
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.01))
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_transform_is_row_wise_so_p_and_q_match_position_by_position():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    config = SamplingConfig(temperature=0.7, top_k=10, top_p=0.9)
    rows = torch.cat([logits_to_probs(logits[i : i + 1], config) for i in range(3)])
    assert torch.allclose(logits_to_probs(logits, config), rows)


def test_seeded_generator_reproduces_samples():
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), -1)
    a = [sample(probs, make_generator(11)).tolist() for _ in range(3)]
    b = [sample(probs, make_generator(11)).tolist() for _ in range(3)]
    assert a == b


def test_unseeded_generators_differ():
    a, b = make_generator(None), make_generator(None)
    assert a.initial_seed() != b.initial_seed()


def test_gumbel_noise_of_a_position_does_not_depend_on_the_step_that_asks():
    whole = gumbel_noise(5, 10, 6, 50)  # positions 10..15 in one step
    pieces = torch.cat(
        [gumbel_noise(5, 10, 2, 50), gumbel_noise(5, 12, 1, 50), gumbel_noise(5, 13, 3, 50)]
    )
    assert torch.equal(whole, pieces)


def test_gumbel_noise_differs_between_positions_and_seeds():
    rows = torch.cat([gumbel_noise(5, 0, 2, 50), gumbel_noise(6, 0, 1, 50)])  # [3, 50]
    assert not torch.equal(rows[0], rows[1]) and not torch.equal(rows[0], rows[2])
    assert len({position_seed(s, j) for s in range(20) for j in range(20)}) == 400


def test_gumbel_noise_is_standard_gumbel():
    noise = gumbel_noise(0, 0, 40, 1000)  # 40k draws: mean = Euler-Mascheroni, var = pi^2 / 6
    assert torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 0.5772) < 0.02
    assert abs(noise.var().item() - 1.6449) < 0.05
