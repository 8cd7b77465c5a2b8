"""Measuring the cost model on tiny random models: the curve, drafting costs, the engine's use."""

from __future__ import annotations

import torch

from llm_engine import cost_model
from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine
from llm_engine.proposers import make_proposer
from llm_engine.runner import EagerRunner
from tests.llm_engine.test_eagle import head  # noqa: F401  (fixture)


def test_the_verify_curve_has_one_positive_time_per_row_count(target):
    curve = cost_model.measure_verify(EagerRunner(target), max_rows=6, context=32, repeats=2)
    assert len(curve) == 6 and all(ms > 0 for ms in curve)


def test_runners_measured_side_by_side_each_get_their_own_curve(target):
    big = EagerRunner(target)
    curves = cost_model.measure_verify_side_by_side([big, big], max_rows=3, context=16,
                                                    repeats=1)
    assert len(curves) == 2 and all(len(c) == 3 and min(c) > 0 for c in curves)


def test_drafting_is_measured_through_each_proposers_own_interface(target, draft, head):  # noqa: F811
    runner, spec = EagerRunner(target), SpeculationConfig()
    costs = {
        name: cost_model.measure_drafting(make_proposer(name, spec, model), runner, 4, 32, 2)
        for name, model in (("ngram", None), ("draft", draft), ("eagle", head))
    }
    assert all(c.fixed_ms >= 0 and c.per_token_ms >= 0 for c in costs.values())
    # Four model forwards cost more than lookups in a table. Compared as whole drafts of 4: the
    # split into fixed and per-token parts is a fit of two noisy timings on a shared machine.
    def four(c):
        return c.fixed_ms + 4 * c.per_token_ms

    assert four(costs["draft"]) > four(costs["ngram"])
    assert four(costs["eagle"]) > four(costs["ngram"])


def test_the_engine_measures_every_proposer_it_can_build(target, tokenizer, draft):
    engine = SpeculativeEngine(
        target, tokenizer,
        EngineConfig(speculation=SpeculationConfig(max_draft_tokens=5),
                     sampling=SamplingConfig(max_new_tokens=8)),
        draft_model=draft)
    assert engine.cost_model.max_rows == 6
    # No EAGLE head loaded; the grammar proposer needs no model.
    assert set(engine.cost_model.draft) == {"ngram", "draft", "grammar"}
    assert engine.plain_cost.ms == engine.cost_model.plain_ms


def test_a_cached_cost_model_is_used_instead_of_measuring(target, tokenizer, tmp_path):
    store = cost_model.CostModelCache(tmp_path)
    key = {**cost_model.machine_key(torch.device("cpu")),
           "target": cost_model.model_key(target), "format": "float32"}
    made = cost_model.CostModel([1.0, 1.5, 2.0], context=16, key=key)
    store.save(made)
    engine = SpeculativeEngine(
        target, tokenizer,
        EngineConfig(speculation=SpeculationConfig(max_draft_tokens=2)),
        cost_model=store.load(key))
    assert engine.cost_model == made


def test_a_cached_model_measured_under_load_is_replaced_but_not_one_read_under_load(target):
    runner = EagerRunner(target)
    # The machine's calm step: the fastest of a few readings (the suite's other worker may hold a
    # core during one; a slow first reading made still_valid's own reading 1.6x faster on CI).
    now = min(cost_model.measure_verify(runner, 1, context=16, repeats=3)[0] for _ in range(5))
    calm = cost_model.CostModel([now], context=16)
    # 100x slower than the machine: still_valid's own reading took over 6x the calm one once,
    # with the suite's other worker busy on the second core.
    under_load = cost_model.CostModel([now * 100], context=16)
    faster_than_now = cost_model.CostModel([now / 10], context=16)  # as if read now under load
    assert cost_model.still_valid(calm, runner)
    assert not cost_model.still_valid(under_load, runner)
    assert cost_model.still_valid(faster_than_now, runner)


def test_the_machine_key_names_the_processor_and_threads():
    key = cost_model.machine_key(torch.device("cpu"))
    assert key["processor"] and key["threads"] == torch.get_num_threads()
