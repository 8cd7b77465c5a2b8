"""The draft-length controller and the cost gate."""

from __future__ import annotations

from llm_engine.adaptive import AdaptiveK, CostGate, PlainStepCost, fill_rows


def calibrated(ms: float) -> PlainStepCost:
    plain = PlainStepCost(warmup_steps=0)
    plain.observe(ms)
    return plain


# -- AdaptiveK ------------------------------------------------------------------------------------


def test_k_grows_while_everything_is_accepted_up_to_max():
    control = AdaptiveK(k=2, min_k=1, max_k=5)
    for _ in range(20):
        control.observe(drafted=control.k, accepted=control.k)
    assert control.k == 5


def test_k_shrinks_while_nothing_is_accepted_down_to_min():
    control = AdaptiveK(k=6, min_k=2, max_k=8)
    for _ in range(20):
        control.observe(drafted=control.k, accepted=0)
    assert control.k == 2


def test_k_does_not_move_on_a_single_step():
    control = AdaptiveK(k=4, min_k=1, max_k=8, patience=2)
    control.observe(drafted=4, accepted=0)
    assert control.k == 4


def test_k_does_not_flap_between_good_and_bad_steps():
    control = AdaptiveK(k=4, min_k=1, max_k=8)
    history = []
    for i in range(20):
        control.observe(drafted=4, accepted=3 if i % 2 else 2)
        history.append(control.k)
    assert history == [4] * 20  # the EMA stays in the dead band between the thresholds


def test_a_fully_accepted_draft_doubles_k_up_to_max():
    control = AdaptiveK(k=4, min_k=1, max_k=10)
    control.observe(drafted=4, accepted=4)
    assert control.k == 8  # one step, no patience: a read-back has started
    control.observe(drafted=8, accepted=8)
    assert control.k == 10


def test_a_short_fully_accepted_draft_sets_k_to_twice_its_length_never_less():
    control = AdaptiveK(k=6, min_k=1, max_k=10)
    control.observe(drafted=2, accepted=2)  # the n-gram's continuation ran out after 2 tokens
    assert control.k == 6
    control = AdaptiveK(k=2, min_k=1, max_k=10)
    control.observe(drafted=2, accepted=2)  # a re-probe capped at 2 tokens
    assert control.k == 4


def test_k_halves_after_patience_steps_of_low_acceptance():
    control = AdaptiveK(k=10, min_k=1, max_k=10, patience=2)
    control.observe(drafted=10, accepted=0)
    assert control.k == 10
    control.observe(drafted=10, accepted=1)
    assert control.k == 5


def test_disabled_controller_keeps_k():
    control = AdaptiveK(k=4, min_k=1, max_k=8, enabled=False)
    for _ in range(10):
        control.observe(drafted=4, accepted=0)
    assert control.k == 4


def test_steps_without_a_draft_do_not_count():
    control = AdaptiveK(k=4, min_k=1, max_k=8)
    for _ in range(10):
        control.observe(drafted=0, accepted=0)
    assert control.k == 4 and control.acceptance is None


def test_fill_rows_rounds_the_verified_rows_up_to_the_multiple():
    assert [fill_rows(k, 4) for k in range(12)] == [0, 3, 3, 3, 7, 7, 7, 7, 11, 11, 11, 11]
    assert [fill_rows(k, 1) for k in range(5)] == [0, 1, 2, 3, 4]


# -- PlainStepCost --------------------------------------------------------------------------------


def test_plain_cost_skips_warmup_then_takes_the_median():
    plain = PlainStepCost(warmup_steps=1)
    plain.observe(100.0)  # the first step of a process pays one-off costs
    assert not plain.ready
    for ms in (10.0, 12.0, 300.0, 11.0):  # 300: another process took the CPU for a moment
        plain.observe(ms)
    assert plain.ms == 11.5


# -- CostGate -------------------------------------------------------------------------------------


def test_gate_waits_for_a_plain_step_measurement():
    gate = CostGate(PlainStepCost(warmup_steps=0))
    assert gate.limit(4) == 0
    gate.observe(drafted=0, committed=1, ms=10.0)
    assert gate.limit(4) == 4


def test_gate_closes_when_speculation_costs_more_per_token_than_a_plain_step():
    gate = CostGate(calibrated(10.0), min_steps=4)
    for _ in range(4):
        gate.observe(drafted=4, committed=2, ms=25.0)  # 12.5 ms per token > 10 ms
    assert gate.limit(4) == 0
    assert gate.closed_count == 1


def test_gate_closes_after_two_steps_that_accepted_nothing_whatever_the_timer_says():
    gate = CostGate(calibrated(10.0))  # default min_steps = 2
    gate.observe(drafted=4, committed=1, ms=9.0)  # noise: a 5-row verify is never cheaper
    assert gate.limit(4) == 4
    gate.observe(drafted=4, committed=1, ms=8.0)
    assert gate.limit(4) == 0


def test_gate_stays_open_when_speculation_pays():
    gate = CostGate(calibrated(10.0))
    for _ in range(20):
        gate.observe(drafted=4, committed=3, ms=18.0)  # 6 ms per token
    assert gate.limit(4) == 4
    assert gate.closed_count == 0


def test_gate_stays_open_on_half_a_token_accepted_per_cheap_step():
    gate = CostGate(calibrated(10.0))
    gate.observe(drafted=2, committed=1, ms=12.0)
    gate.observe(drafted=2, committed=2, ms=12.0)  # 12 ms / 1.5 tokens = 8 ms per token
    assert gate.limit(2) == 2


def test_gate_ignores_one_stalled_step():
    gate = CostGate(calibrated(10.0), min_steps=4)
    for ms in (18.0, 18.0, 500.0, 18.0, 18.0):
        gate.observe(drafted=4, committed=3, ms=ms)
    assert gate.limit(4) == 4


def test_gate_decides_only_after_min_steps():
    gate = CostGate(calibrated(10.0), min_steps=2)
    gate.observe(drafted=4, committed=1, ms=50.0)
    assert gate.limit(4) == 4


def test_gate_reprobes_after_plain_steps_with_backoff():
    gate = CostGate(calibrated(10.0), min_steps=1, reprobe_steps=3)
    gate.observe(drafted=4, committed=1, ms=18.0)
    assert gate.limit(4) == 0
    for _ in range(3):
        gate.observe(drafted=0, committed=1, ms=10.0)
    assert gate.limit(4) > 0  # re-probe
    gate.observe(drafted=2, committed=1, ms=12.0)
    assert gate.limit(4) == 0
    for _ in range(3):
        gate.observe(drafted=0, committed=1, ms=10.0)
    assert gate.limit(4) == 0  # the second wait is twice as long
    for _ in range(3):
        gate.observe(drafted=0, committed=1, ms=10.0)
    assert gate.limit(4) > 0


def test_reprobe_drafts_few_tokens_until_it_passes():
    gate = CostGate(calibrated(10.0), min_steps=2, reprobe_steps=1, probe_k=2)
    assert gate.limit(8) == 8  # the request's first probe uses the full K
    for _ in range(2):
        gate.observe(drafted=8, committed=1, ms=15.0)
    gate.observe(drafted=0, committed=1, ms=10.0)
    assert gate.limit(8) == 2  # re-probing: cheap rows
    gate.observe(drafted=2, committed=3, ms=11.0)
    assert gate.limit(8) == 2  # one step is not yet evidence
    gate.observe(drafted=2, committed=3, ms=11.0)
    assert gate.limit(8) == 8  # passed: the controller's K again


def test_disabled_gate_always_allows():
    gate = CostGate(PlainStepCost(), enabled=False, min_steps=1)
    gate.observe(drafted=4, committed=1, ms=1000.0)
    assert gate.limit(4) == 4
