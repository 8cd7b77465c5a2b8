"""The cost model, the draft-length controller and the cost gate."""

from __future__ import annotations

from llm_engine.adaptive import CostGate, DraftLength, PlainStepCost
from llm_engine.cost_model import CostModel, CostModelCache, DraftCost, expected_tokens


def calibrated(ms: float) -> PlainStepCost:
    plain = PlainStepCost(warmup_steps=0)
    plain.observe(ms)
    return plain


# -- CostModel -------------------------------------------------------------------------------------

# A CPU-like verify curve: 3 rows cost more than 4 (row blocks), 8 rows ~1.2 plain steps.
CPU_CURVE = [50.0, 70.0, 90.0, 60.0, 66.0, 68.0, 70.0, 60.0, 75.0, 80.0, 85.0, 70.0]


def costs(curve=CPU_CURVE, draft=None) -> CostModel:
    return CostModel(list(curve), context=256, draft=draft or {})


def test_expected_tokens_is_the_accepted_prefix_plus_one():
    assert expected_tokens(0, 0.5) == 1.0
    assert expected_tokens(3, 1.0) == 4.0
    assert expected_tokens(2, 0.5) == 1.75


def test_rows_pad_up_to_a_clearly_cheaper_row_count():
    model = costs()
    assert [model.rows(n) for n in (1, 2, 3, 4, 5, 8, 12)] == [1, 4, 4, 4, 8, 8, 12]


def test_rows_do_not_pad_on_a_flat_curve():
    model = costs([10.0, 10.0, 10.2, 10.1])
    assert [model.rows(n) for n in range(1, 5)] == [1, 2, 3, 4]


def test_best_k_is_zero_when_nothing_is_accepted():
    assert costs().best_k("ngram", 0.0, max_k=11) == 0


def test_best_k_is_the_longest_draft_on_a_read_back():
    assert costs().best_k("ngram", 1.0, max_k=11) == 11


def test_best_k_fills_a_whole_row_block_at_moderate_acceptance():
    # 8 rows cost 60 ms, as 4 do: 7 drafts at a = 0.5 commit 1.99 tokens against 1.875 for 3.
    assert costs().best_k("ngram", 0.5, max_k=11) == 7


def test_drafting_cost_shortens_the_best_draft():
    cheap = costs([50.0] * 12)  # verifying is free: only drafting costs
    slow = costs([50.0] * 12, {"draft": DraftCost(0.0, 20.0)})
    assert cheap.best_k("draft", 0.6, 11) == 11
    assert 0 < slow.best_k("draft", 0.6, 11) < 4


def test_predicted_speedup_is_one_when_plain_wins():
    assert costs().speedup("ngram", 0.0, 11) == 1.0
    assert costs().speedup("ngram", 1.0, 11) > 2.0


def test_cost_model_round_trips_through_its_cache(tmp_path):
    store = CostModelCache(tmp_path)
    model = costs(draft={"draft": DraftCost(1.0, 2.5)})
    model.key = {"processor": "x", "format": "bfloat16"}
    store.save(model)
    assert store.load(dict(model.key)) == model
    assert store.load({"processor": "y", "format": "bfloat16"}) is None


# -- DraftLength ---------------------------------------------------------------------------------


def test_k_is_the_configured_one_until_acceptance_is_measured():
    assert DraftLength(costs(), "ngram", k=4, min_k=1, max_k=11).k == 4


def test_k_climbs_to_max_after_a_fully_accepted_draft():
    length = DraftLength(costs(), "ngram", k=4, min_k=1, max_k=11)
    length.observe(drafted=4, accepted=4)
    assert length.k == 11 and length.pays


def test_k_falls_and_speculation_stops_paying_when_nothing_is_accepted():
    length = DraftLength(costs(), "ngram", k=4, min_k=1, max_k=11)
    length.observe(drafted=4, accepted=0)
    assert length.k == 1  # never below min_k: the gate, not K, turns speculation off
    assert length.pays  # one miss is not yet evidence (the prior)
    for _ in range(5):
        length.observe(drafted=4, accepted=0)
    assert not length.pays


def test_where_verifying_is_nearly_free_a_low_acceptance_still_pays():
    flat = costs([50.0, 51.0, 52.0, 53.0] + [54.0] * 8)
    steep = costs([50.0, 90.0, 110.0, 85.0] + [100.0] * 8)
    for model, pays in ((flat, True), (steep, False)):
        length = DraftLength(model, "ngram", k=4, min_k=1, max_k=11)
        for _ in range(2):
            length.observe(drafted=4, accepted=0)
        length.observe(drafted=4, accepted=1)
        assert length.pays is pays


def test_acceptance_counts_the_first_miss_only():
    length = DraftLength(costs(), "ngram", k=4, min_k=1, max_k=11, decay=1.0)
    length.observe(drafted=4, accepted=2)  # 2 accepted, the third rejected, the fourth unjudged
    assert length.acceptance == 2 / 3
    length.observe(drafted=0, accepted=0)  # a plain step says nothing
    assert length.acceptance == 2 / 3


def test_disabled_draft_length_keeps_k():
    length = DraftLength(costs(), "ngram", k=4, min_k=1, max_k=11, enabled=False)
    length.observe(drafted=4, accepted=0)
    assert length.k == 4


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


def test_gate_closes_when_the_cost_model_says_plain_wins():
    gate = CostGate(calibrated(10.0))
    for _ in range(2):
        gate.observe(drafted=2, committed=2, ms=12.0, pays=False)  # timings alone would pass
    assert gate.limit(4) == 0


def test_plain_cost_starts_from_the_cost_model():
    plain = PlainStepCost(initial_ms=42.0)
    assert plain.ready and plain.ms == 42.0


def test_a_gate_without_timings_closes_on_the_prediction_only():
    gate = CostGate(calibrated(10.0), measured=False)
    for _ in range(4):
        gate.observe(drafted=4, committed=1, ms=500.0)  # slow steps: timings are not consulted
    assert gate.limit(4) == 4
    gate.observe(drafted=4, committed=1, ms=5.0, pays=False)
    assert gate.limit(4) == 0
