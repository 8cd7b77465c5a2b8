import asyncio
import contextlib
import math
import threading
import time

import pytest
import torch

from llm_engine import kv
from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine
from llm_engine.serving import EngineWorker
from tests.llm_engine.tiny_models import break_forward, break_forward_once, make_model


def _config(method: str = "ngram", max_new: int = 24) -> EngineConfig:
    return EngineConfig(
        speculation=SpeculationConfig(method=method, gate=False),
        sampling=SamplingConfig(max_new_tokens=max_new),
    )


@pytest.fixture
def serving(target, tokenizer):
    engine = EngineWorker(SpeculativeEngine(target, tokenizer, _config()))
    yield engine
    engine.close()


def _prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


async def test_stream_text_equals_decode_of_tokens(serving, tokenizer):
    handle = serving.submit(_prompt(tokenizer, "Hello, how can I help you today?"))
    deltas = [d async for d in handle]
    result = await handle.result()
    assert "".join(d.text for d in deltas) == result.text
    expected = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.text == expected
    assert result.finish_reason in ("eos", "length")


async def test_stream_matches_the_sync_engine(serving, target, tokenizer):
    prompt = _prompt(tokenizer, "The moon orbits the earth")
    sync = SpeculativeEngine(target, tokenizer, _config())
    expected = [t for step in sync.generate(prompt) for t in step]
    result = await serving.generate(prompt)
    assert result.token_ids == expected


async def test_event_loop_is_not_blocked_while_generating(serving, tokenizer):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    await serving.generate(_prompt(tokenizer, "Thank you for calling."))
    task.cancel()
    assert ticks > 5


async def test_cancel_stops_at_next_step_and_frees_kv(target, tokenizer):
    engine = EngineWorker(SpeculativeEngine(target, tokenizer, _config("off", max_new=400)))
    try:
        handle = engine.submit(_prompt(tokenizer, "Hello"))
        async for _ in handle:
            handle.cancel()
        result = await handle.result()
        assert result.finish_reason == "cancelled"
        assert len(result.token_ids) < 400
        assert handle.state.cache is None  # KV released
        assert result.stats.cancel_to_stop_ms is not None and result.stats.cancel_to_stop_ms >= 0
        # A following request is unaffected.
        follow = await engine.generate(_prompt(tokenizer, "Hello"))
        fresh = SpeculativeEngine(target, tokenizer, _config("off", max_new=400))
        expected = [t for s in fresh.generate(_prompt(tokenizer, "Hello")) for t in s]
        assert follow.token_ids == expected
    finally:
        engine.close()


async def test_cancelling_the_awaiting_task_cancels_the_request(target, tokenizer):
    engine = EngineWorker(SpeculativeEngine(target, tokenizer, _config("off", max_new=400)))
    try:
        handle = engine.submit(_prompt(tokenizer, "Hello"))
        task = asyncio.create_task(handle.result())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if handle.state.finished:
                break
            await asyncio.sleep(0.01)
        assert handle.state.finish_reason == "cancelled"
    finally:
        engine.close()


async def test_requests_are_served_round_robin(target, tokenizer):
    engine = EngineWorker(SpeculativeEngine(target, tokenizer, _config("off", max_new=40)))
    try:
        handles = [engine.submit(_prompt(tokenizer, p)) for p in ("Hello", "The moon")]

        async def times(h):
            return [d.t async for d in h]

        first, second = await asyncio.gather(*(times(h) for h in handles))
        # Interleaved: the second request starts before the first one ends.
        assert second[0] < first[-1]
    finally:
        engine.close()


async def _free_and_stopped(serving, tokenizer):
    """A free run, then the same prompt stopped by a string from the middle of its text."""
    prompt = _prompt(tokenizer, "Hello, how can I help")
    free = await serving.generate(prompt)
    assert len(free.text) > 6
    sampling = SamplingConfig(max_new_tokens=24, stop=[free.text[3:6]])
    return free, await serving.generate(prompt, sampling=sampling)


async def test_stop_string_ends_the_request_without_emitting_it(serving, tokenizer):
    free, stopped = await _free_and_stopped(serving, tokenizer)
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(free.text[3:6])]


async def test_a_stop_string_is_counted_as_stop_not_as_a_cancel(serving, tokenizer):
    free, stopped = await _free_and_stopped(serving, tokenizer)
    assert stopped.stats.finish_reason == "stop"
    assert stopped.stats.cancel_to_stop_ms is None  # no caller cancelled anything
    assert serving.engine.totals.finish_reasons == {free.finish_reason: 1, "stop": 1}


async def test_close_cancels_in_flight_requests(target, tokenizer):
    # No EOS: the random model's greedy reply must not end on its own before the close.
    engine = EngineWorker(SpeculativeEngine(target, tokenizer, _config("off", max_new=1000),
                                            eos_token_ids=set()))
    handle = engine.submit(_prompt(tokenizer, "Hello"))
    await asyncio.sleep(0.05)
    await asyncio.get_running_loop().run_in_executor(None, engine.close)
    result = await asyncio.wait_for(handle.result(), 5)
    assert result.finish_reason == "cancelled"


async def test_a_discarded_request_leaves_its_prefix_kv_to_the_next_one(serving, tokenizer):
    # An early reply is cancelled because the caller went on, and the next request (the whole
    # sentence) is submitted at once, before the worker has honoured the cancel: it must still
    # reuse the discarded request's KV and prefill only the new tokens.
    spoken = _prompt(tokenizer, "User: what is the capital")
    first = serving.submit(spoken, session_id="call")
    async for _ in first:
        break  # it has prefilled and produced its first token
    first.cancel()
    whole = spoken + _prompt(tokenizer, " of Spain and why?")
    second = serving.submit(whole, session_id="call")
    assert (await first.result()).finish_reason == "cancelled"
    stats = (await second.result()).stats
    assert stats.reused_prefix_tokens == len(spoken)
    assert stats.prefill_tokens == len(whole) - len(spoken)


async def test_a_request_behind_its_sessions_one_token_prefill_waits_for_that_kv(serving,
                                                                                tokenizer):
    # A call prefills the conversation so far (one token), and its next request can reach the
    # worker in the same round: it takes the session's KV when that prefill ends in the round,
    # rather than prefilling the whole prompt beside it. (A request that extends the prefill's
    # prompt skips it instead: this one has other words at the end.)
    busy = serving.submit(_prompt(tokenizer, "Hello"), SamplingConfig(max_new_tokens=20),
                          session_id="other")
    async for _ in busy:
        break  # the worker is stepping: the next two wait in its inbox together
    system = _prompt(tokenizer, "System: be brief and kind.")
    warm = serving.submit(system + _prompt(tokenizer, " User: hel"),
                          SamplingConfig(max_new_tokens=1), session_id="call")
    turn = serving.submit(system + _prompt(tokenizer, " Bot: hello"), session_id="call")
    assert len((await warm.result()).token_ids) == 1
    stats = (await turn.result()).stats
    shared = kv.common_prefix_len(warm.state.prompt_ids, turn.state.prompt_ids)
    assert shared >= len(system) and stats.reused_prefix_tokens == shared
    await busy.result()


def _breaking(tokenizer, exc: BaseException, go: threading.Event) -> EngineWorker:
    model = make_model(len(tokenizer))
    engine = SpeculativeEngine(model, tokenizer, _config("off"))
    break_forward(model, exc, go)
    return EngineWorker(engine)


async def test_a_failed_step_is_counted_as_error_not_as_a_cancel(tokenizer):
    go = threading.Event()
    go.set()
    serving = _breaking(tokenizer, RuntimeError("out of memory"), go)
    try:
        result = await asyncio.wait_for(serving.generate(_prompt(tokenizer, "Hello")), 5)
        assert result.finish_reason == result.stats.finish_reason == "error"
        assert "out of memory" in result.error
        assert serving.engine.totals.finish_reasons == {"error": 1}
        assert serving.worker_alive  # one bad request does not take the worker down
    finally:
        serving.close()


async def test_a_dead_worker_fails_its_requests_and_refuses_new_ones(tokenizer):
    # SystemExit (a library calling sys.exit() mid-forward) is what no `except Exception` catches.
    go = threading.Event()
    serving = _breaking(tokenizer, SystemExit("exit called mid-forward"), go)
    try:
        assert serving.worker_alive and serving.worker_error is None
        held = [serving.submit(_prompt(tokenizer, p)) for p in ("Hello", "The moon")]
        go.set()  # both are in the worker's hands when it dies
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in held)), 5)
        assert [r.finish_reason for r in results] == ["error", "error"]
        assert all("worker died: SystemExit: exit called mid-forward" in r.error for r in results)
        assert not serving.worker_alive and "SystemExit" in serving.worker_error
        with pytest.raises(RuntimeError, match="worker died: SystemExit"):
            serving.submit(_prompt(tokenizer, "Hello"))
        assert serving.engine.totals.finish_reasons == {"error": 2}
    finally:
        serving.close()


async def test_a_dead_worker_fails_what_it_held_then_serves_again(tokenizer):
    model = make_model(len(tokenizer))
    serving = EngineWorker(SpeculativeEngine(model, tokenizer, _config("off")), restarts=1)
    try:
        break_forward_once(model, SystemExit("exit called mid-forward"))
        failed = await asyncio.wait_for(serving.generate(_prompt(tokenizer, "Hello")), 5)
        assert failed.finish_reason == "error" and "worker died: SystemExit" in failed.error
        await _until(lambda: serving.worker_alive, 5)
        served = await asyncio.wait_for(serving.generate(_prompt(tokenizer, "Hello")), 10)
        assert served.finish_reason in ("eos", "length") and served.error is None
        assert serving.restarts_done == 1 and "SystemExit" in serving.last_death
    finally:
        serving.close()


async def test_a_worker_that_keeps_dying_stays_down_after_its_restarts(tokenizer):
    go = threading.Event()
    go.set()
    serving = _breaking(tokenizer, SystemExit("exit called mid-forward"), go)
    serving.restarts = 1
    try:
        for _ in range(2):
            await _until(lambda: serving.worker_alive, 5)
            failed = await asyncio.wait_for(serving.generate(_prompt(tokenizer, "Hello")), 5)
            assert failed.finish_reason == "error"
        await asyncio.sleep(1.5)  # past the next backoff: no third life
        assert not serving.worker_alive and serving.restarts_done == 1
        with pytest.raises(RuntimeError, match="worker died: SystemExit"):
            serving.submit(_prompt(tokenizer, "Hello"))
    finally:
        serving.close()


async def _until(condition, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_build_loads_the_engine_on_the_thread_that_then_serves_it(target, tokenizer):
    threads = []

    class Built:
        def __init__(self):
            threads.append(threading.current_thread())
            self.engine = SpeculativeEngine(target, tokenizer, _config())

    serving, built = EngineWorker.build(Built, name="llm-test")
    try:
        assert serving.engine is built.engine
        assert threads == [serving._thread] and threads[0].name == "llm-test"
        result = await serving.generate(_prompt(tokenizer, "Hello"))
        assert result.finish_reason in ("eos", "length")
    finally:
        serving.close()


def test_a_build_that_fails_raises_its_error_and_serves_nothing():
    def fail():
        raise OSError("weights not found")

    with pytest.raises(OSError, match="weights not found"):
        EngineWorker.build(fail)


async def test_the_event_loop_runs_no_torch_and_compiles_no_grammar(target, draft, tokenizer):
    from llm_engine.grammar import GrammarSpec
    from tests.loop_guard import torch_calls_on_this_thread

    engine = SpeculativeEngine(target, tokenizer, _config(), draft_model=draft)
    serving = EngineWorker(engine)
    prompt = _prompt(tokenizer, "Please confirm the booking.")
    day = {"type": "object", "properties": {"day": {"type": "string"}}}
    tools = GrammarSpec(kind="tools", tool_choice="required",
                        tools=[{"name": "book", "parameters": day}])
    requests = [{}, {"method": "draft", "sampling": SamplingConfig(temperature=0.8, seed=7,
                                                                    max_new_tokens=8)},
                {"method": "grammar+ngram", "sampling": SamplingConfig(grammar=tools)}]
    try:
        with torch_calls_on_this_thread() as hits:
            handles = [serving.submit(prompt, **kwargs) for kwargs in requests]
            results = [await handle.result() for handle in handles]
        assert all(r.finish_reason in ("eos", "length") for r in results), results
        assert engine.compiled_grammars() == 1  # compiled, on the worker
        assert hits == []
    finally:
        serving.close()


def test_the_guard_sees_torch_on_its_thread():
    from tests.loop_guard import torch_calls_on_this_thread

    with torch_calls_on_this_thread() as hits:
        torch.Generator().manual_seed(1)
    assert hits


async def test_next_logprob_is_the_targets_own_while_requests_run(serving, target, tokenizer):
    """A scoring job runs between two rounds of a generating request and answers the target's
    log-probability of the next token (the request is unaffected)."""
    prompt = _prompt(tokenizer, "Hello, how can I help")
    with torch.inference_mode():
        want = target(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
    handle = serving.submit(_prompt(tokenizer, "Hello, how can I help you today?"))
    got = await serving.next_logprob(prompt, [7])
    alone = await serving.generate(_prompt(tokenizer, "Hello, how can I help you today?"))
    assert got == pytest.approx(float(want[7]), abs=1e-4)
    assert (await handle.result()).token_ids == alone.token_ids


async def test_scores_that_share_a_prefix_equal_scores_from_scratch(serving, target, tokenizer):
    """The scoring cache keeps the last prompt; what follows a shared prefix, a shorter prompt
    and an unrelated one must score as if run alone."""
    prompts = [_prompt(tokenizer, text) for text in
               ("Hello, how can I", "Hello, how can I help you", "Hello", "Goodbye, see you")]
    for prompt in prompts:
        with torch.inference_mode():
            want = target(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
        assert await serving.next_logprob(prompt, [11]) == pytest.approx(float(want[11]), abs=1e-4)


def test_a_score_that_goes_on_from_the_last_runs_only_its_new_tokens(target, tokenizer):
    """A caller's words grow between two scores: the second forward carries the new tokens."""
    engine = SpeculativeEngine(target, tokenizer, _config())
    ran = []
    forward = engine.runner.forward
    engine.runner.forward = lambda cache, ids, **kw: ran.append(ids.shape[1]) or forward(
        cache, ids, **kw)
    short = _prompt(tokenizer, "Hello, how can I")
    longer = _prompt(tokenizer, "Hello, how can I help you")
    engine.next_logprob(short, [5])
    engine.next_logprob(longer, [5])
    assert ran == [len(short), len(longer) - len(short)]


async def test_a_one_token_prefill_is_in_flight_but_not_a_reply(target, tokenizer):
    with _plain_worker(target, tokenizer, 16) as serving:
        gate = _gated(serving)  # no step runs until the counts are read
        prefill = serving.submit(_prompt(tokenizer, "Hello"), SamplingConfig(max_new_tokens=1))
        reply = serving.submit(_prompt(tokenizer, "Hello, how can I help you today?"))
        assert (serving.in_flight, serving.replies_in_flight) == (2, 1)
        gate.set()
        await prefill.result()
        await reply.result()
        assert (serving.in_flight, serving.replies_in_flight) == (0, 0)


async def test_a_score_of_several_tokens_is_their_summed_probability(serving, target, tokenizer):
    prompt = _prompt(tokenizer, "Hello, how can I")
    with torch.inference_mode():
        want = target(torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
    got = await serving.next_logprob(prompt, [3, 11, 11, 19])  # a repeat counts once
    assert got == pytest.approx(math.log(float(want[[3, 11, 19]].sum())), abs=1e-4)


async def test_a_bad_scoring_job_fails_alone(serving, tokenizer):
    with pytest.raises(ValueError, match="cannot be scored"):
        await serving.next_logprob([], [7])
    with pytest.raises(ValueError, match="no token"):
        await serving.next_logprob(_prompt(tokenizer, "Hello"), [])
    assert serving.worker_alive
    assert (await serving.generate(_prompt(tokenizer, "Hello"))).finish_reason in ("eos", "length")


def _plain_worker(target, tokenizer, max_new: int):
    """A worker over the `off` engine, closed when the `with` block ends."""
    return contextlib.closing(
        EngineWorker(SpeculativeEngine(target, tokenizer, _config("off", max_new=max_new))))


async def test_a_held_sessions_requests_wait_while_others_step(target, tokenizer):
    with _plain_worker(target, tokenizer, 16) as engine:
        alone = await engine.generate(_prompt(tokenizer, "Hello"), session_id="alone")
        until = threading.Event()
        held = engine.submit(_prompt(tokenizer, "Hello"), session_id="held")
        engine.hold_session("held", until, max_s=60)
        await asyncio.sleep(0)
        other = await asyncio.wait_for(
            engine.generate(_prompt(tokenizer, "The moon"), session_id="other"), 30)
        assert other.finish_reason in ("eos", "length")  # another call's request ran to its end
        # This one stepped at most once before the hold was in place.
        assert not held.done and len(held.state.token_ids) - len(held.state.prompt_ids) <= 1
        until.set()
        done = await asyncio.wait_for(held.result(), 30)
        assert done.token_ids == alone.token_ids  # then it decodes what it would have


async def test_a_hold_ends_at_its_deadline(target, tokenizer):
    with _plain_worker(target, tokenizer, 4) as engine:
        start = time.perf_counter()
        handle = engine.submit(_prompt(tokenizer, "Hello"), session_id="held")
        engine.hold_session("held", threading.Event(), max_s=0.3)  # never released
        first = await asyncio.wait_for(anext(aiter(handle)), 10)
        assert first.t - start >= 0.3  # the first token waited out the hold
        assert (await asyncio.wait_for(handle.result(), 30)).finish_reason == "length"


async def test_a_held_request_that_is_cancelled_ends_at_once(target, tokenizer):
    with _plain_worker(target, tokenizer, 16) as engine:
        handle = engine.submit(_prompt(tokenizer, "Hello"), session_id="held")
        engine.hold_session("held", threading.Event(), max_s=60)
        await asyncio.sleep(0.05)
        handle.cancel()  # a barge-in during the first phrase
        assert (await asyncio.wait_for(handle.result(), 5)).finish_reason == "cancelled"


async def test_a_request_submitted_after_its_sessions_hold_is_not_held(target, tokenizer):
    with _plain_worker(target, tokenizer, 8) as engine:
        engine.hold_session("call", threading.Event(), max_s=60)  # e.g. the turn's next prefill
        done = await asyncio.wait_for(
            engine.generate(_prompt(tokenizer, "Hello"), session_id="call"), 30)
        assert done.finish_reason in ("eos", "length")


async def test_a_worker_sharing_the_cores_steps_on_fewer_threads_while_the_other_work_runs(
        target, tokenizer):
    with _plain_worker(target, tokenizer, 4) as serving:
        busy, seen = [True], []
        step_many = serving.engine.step_many

        def recorded(states):
            seen.append((busy[0], torch.get_num_threads()))
            return step_many(states)

        serving.engine.step_many = recorded
        serving.share_cores(lambda: busy[0], 1, 2)
        await serving.generate(_prompt(tokenizer, "Hello"))
        busy[0] = False
        await serving.generate(_prompt(tokenizer, "The moon"))
    assert {threads for was_busy, threads in seen if was_busy} == {1}
    assert {threads for was_busy, threads in seen if not was_busy} == {2}


def test_a_call_runs_on_the_worker_thread_and_raises_what_it_raised(serving):
    assert serving.call(lambda engine: threading.current_thread().name) == "llm-engine"
    assert serving.call(lambda engine: serving.call(lambda again: 7)) == 7  # no self-deadlock
    with pytest.raises(ZeroDivisionError):
        serving.call(lambda engine: 1 / 0)
    assert serving.worker_alive


def _gated(serving) -> threading.Event:
    """No step of `serving` runs until the returned event is set."""
    gate = threading.Event()
    step_many = serving.engine.step_many
    serving.engine.step_many = lambda states: (gate.wait(30), step_many(states))[1]
    return gate


def _paused(serving) -> threading.Event:
    """`serving` admits nothing until the returned event is set: what is submitted meanwhile
    reaches it at once."""
    gate, started = threading.Event(), threading.Event()
    threading.Thread(target=serving.call,
                     args=(lambda engine: (started.set(), gate.wait(30)),), daemon=True).start()
    assert started.wait(30)
    return gate


@pytest.mark.parametrize("extends, marked, skipped", [
    (True, True, True),
    (False, True, False),  # the reply does not start with the prefill's words
    (True, False, False),  # a one-token request of its own (an API client's), not a prefill
])
async def test_a_prefill_that_a_queued_reply_extends_is_skipped(
        target, tokenizer, extends, marked, skipped):
    with _plain_worker(target, tokenizer, 8) as serving:
        gate = _paused(serving)
        words = _prompt(tokenizer, "Hello, how can I")
        prefill = serving.submit(words, SamplingConfig(max_new_tokens=1), session_id="call",
                                 prefill=marked)
        rest = _prompt(tokenizer, " help you today?")
        reply = serving.submit(words + rest if extends else rest + words, session_id="call")
        gate.set()
        done, answered = await prefill.result(), await reply.result()
    assert (done.finish_reason == "cancelled") == skipped
    assert (done.stats.prefill_tokens == 0) == skipped
    assert answered.finish_reason in ("eos", "length")
    reused = len(words) if extends and not skipped else 0  # the prefill's KV, when it ran
    assert answered.stats.prefill_tokens == len(reply.state.prompt_ids) - reused


async def test_a_prefill_of_another_session_is_not_skipped(target, tokenizer):
    with _plain_worker(target, tokenizer, 8) as serving:
        gate = _paused(serving)
        prefill = serving.submit(_prompt(tokenizer, "Hello"), SamplingConfig(max_new_tokens=1),
                                 session_id="one", prefill=True)
        reply = serving.submit(_prompt(tokenizer, "Hello there"), session_id="two")
        gate.set()
        assert (await prefill.result()).finish_reason == "length"
        await reply.result()


async def test_a_prefill_is_not_skipped_for_a_reply_already_cancelled(target, tokenizer):
    with _plain_worker(target, tokenizer, 8) as serving:
        gate = _paused(serving)
        words = _prompt(tokenizer, "Hello, how can I")
        prefill = serving.submit(words, SamplingConfig(max_new_tokens=1), session_id="call",
                                 prefill=True)
        reply = serving.submit(words + _prompt(tokenizer, " help?"), session_id="call")
        reply.cancel()  # the caller went on: its KV must still get the words
        gate.set()
        assert (await prefill.result()).finish_reason == "length"
        assert (await reply.result()).finish_reason == "cancelled"

