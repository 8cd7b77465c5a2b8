"""`llm.fallback`: a primary backend that hangs, refuses connections or answers, against a real
socket each time; the fallback is a tiny in-process engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from llm_engine.config import SamplingConfig
from llm_engine.serving import Completion, DeltaStream
from llm_engine.stats import RequestStats
from tests.voiceagent.server_proc import free_port
from tests.voiceagent.serving import server_config, serving
from tests.voiceagent.tiny_shared import tiny_shared
from voiceagent.config import ConfigError, LLMConfig, load_config
from voiceagent.pipeline.failover import FailoverChat
from voiceagent.pipeline.remote_llm import RemoteChat

HELLO = [{"role": "user", "content": "Hello there"}]
SAMPLING = SamplingConfig(max_new_tokens=8, temperature=0.0)
MODEL = "smollm2-135m-instruct"  # what a default-config server's /v1 serves


def _remote(base_url: str, name: str) -> RemoteChat:
    cfg = LLMConfig(backend="openai", base_url=base_url, timeout_s=30)
    return RemoteChat(cfg, MODEL, name, SAMPLING)


@pytest.fixture
def fallback():
    shared = tiny_shared(eos=False)
    yield shared.chat
    shared.close()


@pytest.fixture
async def hung_server():
    """A server that takes the connection and the request, and never answers."""
    async def never_answer(reader, _writer):
        await reader.read(65536)
        await asyncio.Event().wait()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    server.close()


async def test_a_primary_that_gives_no_first_token_is_replaced_by_the_fallback(
        hung_server, fallback):
    chat = FailoverChat(_remote(hung_server, "hung"), fallback, first_token_timeout_s=0.5)
    t0 = time.monotonic()
    handle = chat.submit(HELLO, SAMPLING, "call-1", None)
    completion = await asyncio.wait_for(handle.result(), 20)
    assert completion.finish_reason == "length" and completion.text
    assert completion.stats.method == fallback.name  # the turn shows who served it
    assert handle.failover == "no first token in 0.5 s" and chat.failovers == 1
    assert time.monotonic() - t0 < 10  # not the primary's 30 s timeout
    # the next request does not wait for the primary again: it is skipped for a while
    second = chat.submit(HELLO, SAMPLING, "call-1", None)
    assert (await asyncio.wait_for(second.result(), 20)).text
    assert second.failover == "the primary failed lately" and chat.failovers == 2


async def test_a_primary_that_refuses_the_connection_is_replaced_at_once(fallback):
    chat = FailoverChat(_remote(f"http://127.0.0.1:{free_port()}/v1", "gone"), fallback,
                        first_token_timeout_s=5)
    handle = chat.submit(HELLO, SAMPLING, "call-1", None)
    completion = await asyncio.wait_for(handle.result(), 20)
    assert completion.text and completion.stats.method == fallback.name
    assert "Connection" in handle.failover
    assert chat.last_error is not None  # /healthz says degraded while the primary fails


async def test_a_primary_that_answers_serves_and_the_fallback_is_untouched(tmp_path, fallback):
    served = tiny_shared(eos=False)
    try:
        async with serving(server_config(tmp_path), served) as (_app, base):
            chat = FailoverChat(_remote(f"{base}/v1", "primary"), fallback, 5)
            handle = chat.submit(HELLO, SAMPLING, "call-1", None)
            deltas = [d.text async for d in handle]
            completion = await handle.result()
    finally:
        served.close()
    assert completion.stats.method == "primary" and "".join(deltas) == completion.text
    assert handle.failover is None and chat.failovers == 0


async def test_cancelling_while_the_primary_hangs_ends_the_request(hung_server, fallback):
    chat = FailoverChat(_remote(hung_server, "hung"), fallback, first_token_timeout_s=30)
    handle = chat.submit(HELLO, SAMPLING, "call-1", None)
    await asyncio.sleep(0.3)
    handle.cancel()
    completion = await asyncio.wait_for(handle.result(), 5)
    assert completion.finish_reason == "cancelled" and chat.failovers == 0


def test_a_fallback_may_not_have_a_fallback_of_its_own():
    with pytest.raises(ConfigError, match="one is the limit"):
        load_config(None, ["llm.backend=openai", "llm.base_url=http://x/v1",
                           "llm.fallback={backend: openai, base_url: 'http://y/v1', "
                           "fallback: {backend: engine}}"])


@pytest.mark.slow
async def test_a_call_whose_primary_hangs_is_answered_by_the_fallback(tmp_path, models,
                                                                      hung_server):
    """A Twilio call on the real models: the remote primary never answers, the in-process
    engine does, and the stored turn says which served it."""
    from tests.audio.speech import speech
    from tests.voiceagent.serving import twilio_url, until
    from voiceagent.pipeline.builder import SharedModels
    from voiceagent.sim.twilio_caller import TwilioCaller

    failover = FailoverChat(_remote(hung_server, "hung"), models.chat, first_token_timeout_s=1)
    shared = SharedModels(llm=models.llm, worker=models.worker, chat=failover,
                          speech=models.speech)
    async with serving(server_config(tmp_path), shared) as (app, base):
        async with TwilioCaller(twilio_url(base)) as caller:
            await caller.start()
            said = await caller.say(speech("What is the capital of France?"))
            assert await caller.wait(lambda r: r.media_after(said.ended) and r.marks, 45)
            await caller.hang_up()
        records = app.state.server.records.by_call
        assert await until(lambda: records, 10)
        await app.state.server.calls.wait_idle(10)
    [record] = next(iter(records.values()))
    assert record.bot_text and record.engine.method == models.chat.name
    assert failover.failovers >= 1


class _ToolCallingPrimary:
    """A primary whose answer streams no text, as a tool call does (or a request cancelled
    before its first token)."""

    name = model = "tools"

    def __init__(self, reason: str):
        self.reason = reason

    def submit(self, *request) -> DeltaStream:
        handle = DeltaStream(asyncio.get_running_loop())
        handle._queue.put_nowait(handle.END)
        handle._completion.set_result(Completion("", [], self.reason,
                                                 RequestStats(method="tools")))
        return handle

    def drop_session(self, session_id: str) -> None:
        pass


@pytest.mark.parametrize("reason, degraded", [("eos", False), ("cancelled", True)])
async def test_a_primary_that_serves_a_tool_call_is_no_longer_degraded(fallback, reason,
                                                                        degraded):
    chat = FailoverChat(_ToolCallingPrimary(reason), fallback, first_token_timeout_s=5)
    chat.primary_error = "no first token in 2 s"  # an earlier request failed over
    completion = await asyncio.wait_for(chat.submit(HELLO, SAMPLING, "call-1", None).result(), 5)
    assert completion.stats.method == "tools" and chat.failovers == 0
    assert (chat.last_error is not None) == degraded  # a cancel proves nothing either way

