"""The draft-length controller and the cost gate."""

from __future__ import annotations

from llm_engine.adaptive import AdaptiveK, CostGate, PlainStepCost


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
        control.observe(drafted=4, accepted=4 if i % 2 else 0)
        history.append(control.k)
    assert history == [4] * 20  # the EMA stays in the dead band between the thresholds


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
    assert not gate.allows()
    gate.observe(drafted=0, committed=1, ms=10.0)
    assert gate.allows()


def test_gate_closes_when_speculation_costs_more_per_token_than_a_plain_step():
    gate = CostGate(calibrated(10.0), min_steps=4)
    for _ in range(4):
        gate.observe(drafted=4, committed=1, ms=18.0)  # 18 ms per token > 10 ms
    assert not gate.allows()
    assert gate.closed_count == 1


def test_gate_stays_open_when_speculation_pays():
    gate = CostGate(calibrated(10.0), min_steps=4)
    for _ in range(20):
        gate.observe(drafted=4, committed=3, ms=18.0)  # 6 ms per token
    assert gate.allows()
    assert gate.closed_count == 0


def test_gate_ignores_one_stalled_step():
    gate = CostGate(calibrated(10.0), min_steps=4)
    for ms in (18.0, 18.0, 500.0, 18.0, 18.0):
        gate.observe(drafted=4, committed=3, ms=ms)
    assert gate.allows()


def test_gate_decides_only_after_min_steps():
    gate = CostGate(calibrated(10.0), min_steps=4)
    for _ in range(3):
        gate.observe(drafted=4, committed=1, ms=50.0)
    assert gate.allows()


def test_gate_reprobes_after_plain_steps_with_backoff():
    gate = CostGate(calibrated(10.0), min_steps=1, reprobe_steps=3)
    gate.observe(drafted=4, committed=1, ms=18.0)
    assert not gate.allows()
    for _ in range(3):
        gate.observe(drafted=0, committed=1, ms=10.0)
    assert gate.allows()  # re-probe
    gate.observe(drafted=4, committed=1, ms=18.0)
    assert not gate.allows()
    for _ in range(3):
        gate.observe(drafted=0, committed=1, ms=10.0)
    assert not gate.allows()  # the second wait is twice as long
    for _ in range(3):
        gate.observe(drafted=0, committed=1, ms=10.0)
    assert gate.allows()


def test_disabled_gate_always_allows():
    gate = CostGate(PlainStepCost(), enabled=False, min_steps=1)
    gate.observe(drafted=4, committed=1, ms=1000.0)
    assert gate.allows()
