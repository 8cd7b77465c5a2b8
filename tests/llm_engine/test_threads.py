"""The engine's thread count, measured beside a load, on a tiny random model."""

from __future__ import annotations

import contextlib

import pytest
import torch

from llm_engine import threads
from llm_engine.runner import EagerRunner


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cores, counts", [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]),
                                           (8, [1, 2, 4, 8])])
def test_the_candidates_double_up_to_the_cores(cores, counts):
    assert threads.candidates(cores) == counts


@pytest.mark.parametrize("step_ms, chosen", [({1: 21.0, 2: 20.5}, 1), ({1: 30.0, 2: 20.0}, 2),
                                             ({1: 40.0, 2: 22.0, 4: 21.5}, 2)])
def test_the_fewest_threads_within_five_percent_of_the_fastest_win(step_ms, chosen):
    assert threads.fewest_as_fast(step_ms) == chosen


def test_each_count_is_timed_while_the_load_runs_and_the_choice_is_set(target, torch_threads):
    events = []

    @contextlib.contextmanager
    def load():
        events.append("start")
        yield
        events.append(("stop", torch.get_num_threads()))

    runner = EagerRunner(target)
    timed = []
    forward = runner.forward

    def counted(*args, **kwargs):
        timed.append((len(events), torch.get_num_threads()))
        return forward(*args, **kwargs)

    runner.forward = counted
    chosen, medians = threads.choose_threads(runner, [1, 2], load, context=16, repeats=2)
    assert set(medians) == {1, 2} and all(ms > 0 for ms in medians.values())
    assert {count for _, count in timed} == {1, 2}  # both counts ran
    assert all(started == 1 for started, _ in timed)  # every forward inside the load
    assert events[-1][0] == "stop" and torch.get_num_threads() == chosen


def test_logits_that_differ_with_the_thread_count_are_found(target, torch_threads):
    runner = EagerRunner(target)
    forward = runner.forward

    def on_one_thread(*args, **kwargs):  # the kernels ignore the count the engine asks for
        asked = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return forward(*args, **kwargs)
        finally:
            torch.set_num_threads(asked)

    def thread_dependent(*args, **kwargs):
        out = on_one_thread(*args, **kwargs)
        out.logits.add_(torch.get_num_threads() * 1e-6)
        return out

    torch.set_num_threads(2)
    runner.forward = on_one_thread
    assert threads.identical_logits(runner, [1, 2], rows=4, chunk=16, context=16)
    runner.forward = thread_dependent
    assert not threads.identical_logits(runner, [1, 2], rows=4, chunk=16, context=16)
    assert torch.get_num_threads() == 2  # left as it was
