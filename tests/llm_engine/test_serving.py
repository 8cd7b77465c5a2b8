import asyncio

import pytest

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.engine import SpeculativeEngine
from llm_engine.serving import AsyncEngine


def _config(method: str = "ngram", max_new: int = 24) -> EngineConfig:
    return EngineConfig(
        speculation=SpeculationConfig(method=method, gate=False),
        sampling=SamplingConfig(max_new_tokens=max_new),
    )


@pytest.fixture
def serving(target, tokenizer):
    engine = AsyncEngine(SpeculativeEngine(target, tokenizer, _config()))
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
    engine = AsyncEngine(SpeculativeEngine(target, tokenizer, _config("off", max_new=400)))
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
    engine = AsyncEngine(SpeculativeEngine(target, tokenizer, _config("off", max_new=400)))
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
    engine = AsyncEngine(SpeculativeEngine(target, tokenizer, _config("off", max_new=40)))
    try:
        handles = [engine.submit(_prompt(tokenizer, p)) for p in ("Hello", "The moon")]

        async def times(h):
            return [d.t async for d in h]

        first, second = await asyncio.gather(*(times(h) for h in handles))
        # Interleaved: the second request starts before the first one ends.
        assert second[0] < first[-1]
    finally:
        engine.close()


async def test_stop_string_ends_the_request_without_emitting_it(serving, tokenizer):
    prompt = _prompt(tokenizer, "Hello, how can I help")
    free = await serving.generate(prompt)
    assert len(free.text) > 6
    stop = free.text[3:6]
    sampling = SamplingConfig(max_new_tokens=24, stop=[stop])
    stopped = await serving.generate(prompt, sampling=sampling)
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]


async def test_close_cancels_in_flight_requests(target, tokenizer):
    engine = AsyncEngine(SpeculativeEngine(target, tokenizer, _config("off", max_new=1000)))
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
