"""The process's speech workers (`voiceagent.pipeline.speech_worker`): one job at a time, urgent
ones first, a cancelled job never run, a job's error its caller's, and background jobs held a
while when a reply opens."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from voiceagent.pipeline.speech_worker import BACKGROUND, CRITICAL, Openings, SpeechWorker


@pytest.fixture
def worker():
    w = SpeechWorker("test-worker")
    yield w
    w.close()


async def test_a_critical_job_overtakes_queued_background_ones(worker):
    gate, ran = threading.Event(), []
    busy = asyncio.ensure_future(worker.run(gate.wait, 5))  # holds the worker
    await asyncio.sleep(0.05)
    jobs = [asyncio.ensure_future(worker.run(ran.append, name, priority=priority))
            for name, priority in (("interim 1", BACKGROUND), ("interim 2", BACKGROUND),
                                   ("final", CRITICAL))]
    await asyncio.sleep(0.05)
    gate.set()
    await asyncio.gather(busy, *jobs)
    assert ran == ["final", "interim 1", "interim 2"]


async def test_a_job_whose_caller_stopped_waiting_is_not_run(worker):
    gate, ran = threading.Event(), []
    busy = asyncio.ensure_future(worker.run(gate.wait, 5))
    await asyncio.sleep(0.05)
    dropped = asyncio.ensure_future(worker.run(ran.append, "dropped"))
    kept = asyncio.ensure_future(worker.run(ran.append, "kept"))
    await asyncio.sleep(0.05)
    dropped.cancel()
    gate.set()
    await asyncio.gather(busy, kept)
    assert ran == ["kept"]


async def test_a_failing_job_raises_in_its_caller_and_the_worker_goes_on(worker):
    def fail():
        raise ValueError("bad audio")

    with pytest.raises(ValueError, match="bad audio"):
        await worker.run(fail, priority=CRITICAL)
    assert await worker.run(lambda: 42) == 42


async def test_closing_fails_the_queued_jobs_and_refuses_new_ones():
    worker = SpeechWorker("closing-worker")
    gate = threading.Event()
    busy = asyncio.ensure_future(worker.run(gate.wait, 5))
    await asyncio.sleep(0.05)
    queued = asyncio.ensure_future(worker.run(lambda: "never"))
    await asyncio.sleep(0.05)
    closing = asyncio.get_running_loop().run_in_executor(None, worker.close)
    gate.set()
    await closing
    assert await busy  # the job in progress finishes
    with pytest.raises(RuntimeError, match="closed"):
        await queued
    with pytest.raises(RuntimeError, match="closed"):
        await worker.run(lambda: "late")


async def test_a_background_job_waits_while_a_reply_opens_and_a_critical_one_does_not():
    openings = Openings()
    worker = SpeechWorker("held-worker", openings, hold_s=5.0)
    try:
        ran: list[str] = []
        openings.open("call a")
        interim = asyncio.ensure_future(worker.run(ran.append, "interim", priority=BACKGROUND))
        await asyncio.sleep(0.1)
        assert ran == []
        await asyncio.wait_for(worker.run(ran.append, "first phrase", priority=CRITICAL), 1)
        assert ran == ["first phrase"]
        openings.close("call a")  # its first audio is out
        await asyncio.wait_for(interim, 1)
        assert ran == ["first phrase", "interim"]
    finally:
        worker.close()


@pytest.mark.parametrize("jobs", [1, 2])
async def test_held_background_jobs_run_after_one_hold_even_while_the_reply_is_open(jobs):
    """Jobs queued together wait together, not one hold after another."""
    openings = Openings()
    worker = SpeechWorker("held-worker", openings, hold_s=0.3)
    openings.open("call a")
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.gather(*(worker.run(lambda: None) for _ in range(jobs))),
                               2)
    finally:
        worker.close()
    assert 0.3 <= time.monotonic() - t0 < 0.55


def test_an_opening_left_open_lapses():
    openings = Openings(lapse_s=0.05)
    openings.open("call a")
    assert openings.any()
    time.sleep(0.06)
    assert not openings.any()
