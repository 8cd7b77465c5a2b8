"""The pipeline's LLM on a remote OpenAI-compatible server (voiceagent.pipeline.remote_llm),
against a real one: `serve`'s own `/v1` on a loopback port with a tiny random engine (ngram
speculation), so the remote's per-request speculation comes back too. The pipeline through a
whole call on a remote in another process is in test_remote_call.py."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from pipecat.frames.frames import InterruptionFrame, LLMContextFrame, LLMTextFrame, MetricsFrame
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.tests.utils import SleepFrame, run_test

from llm_engine.config import SamplingConfig
from llm_engine.prompts import encode_chat
from tests.voiceagent.serving import server_config, serving, until
from tests.voiceagent.tiny_shared import tiny_shared
from voiceagent.config import LLMConfig
from voiceagent.pipeline.builder import SharedModels
from voiceagent.pipeline.chat_backend import ToolUse
from voiceagent.pipeline.llm_service import ChatLLMService
from voiceagent.pipeline.metrics import EngineStatsMetricsData
from voiceagent.pipeline.remote_llm import (
    RemoteChat,
    RemoteLLMError,
    connect,
    speculation_counters,
)

MODEL = "smollm2-135m-instruct"  # the id the server's /v1 serves (its config's target)
HELLO = [{"role": "user", "content": "Hello there, who are you?"}]
KEY_ENV = "VOICEAGENT_TEST_REMOTE_KEY"


@pytest.fixture
async def remote(tmp_path, monkeypatch):
    """(app, /v1 URL, shared models) of a real server that needs the key in KEY_ENV."""
    async with _remote(tmp_path, monkeypatch, tiny_shared(method="ngram")) as served:
        yield served


@pytest.fixture
async def slow_remote(tmp_path, monkeypatch):
    """The same, speculation off and 20 ms a forward, replies never ending by themselves: a
    2000-token reply lasts 40 s, so a barge-in always finds it mid-stream."""
    shared = tiny_shared(eos=False)
    shared.llm.target.model.get_decoder().register_forward_pre_hook(
        lambda _module, _args: time.sleep(0.02))
    async with _remote(tmp_path, monkeypatch, shared) as served:
        yield served


@asynccontextmanager
async def _remote(tmp_path, monkeypatch, shared):
    monkeypatch.setenv(KEY_ENV, "s3cret")
    try:
        async with serving(server_config(tmp_path, "server.token=s3cret"), shared) as (app, base):
            yield app, f"{base}/v1", shared
    finally:
        shared.close()


def _llm(base_url: str | None, **settings) -> LLMConfig:
    return LLMConfig(backend="openai", base_url=base_url, api_key_env=KEY_ENV, **settings)


async def _connect(cfg: LLMConfig, sampling: SamplingConfig | None = None):
    # connect() blocks; the server runs on this event loop.
    return await asyncio.to_thread(connect, cfg, sampling or SamplingConfig())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_connect_takes_the_only_model_and_names_the_backend_after_the_server(remote):
    _app, url, _shared = remote
    chat = await _connect(_llm(url))
    named = await _connect(_llm(url, model=MODEL, name="box-2"))
    assert (chat.model, chat.name) == (MODEL, "voiceagent")
    assert named.name == "box-2"


@pytest.mark.parametrize("case,reason", [
    ("no base_url", "llm.base_url is not set"),
    ("wrong key", f"refused the API key: set it in the environment variable {KEY_ENV}"),
    ("unserved model", "does not serve 'gpt-4o'"),
    ("nothing listening", "did not answer /models"),
])
async def test_connect_refuses_with_the_reason(remote, monkeypatch, case, reason):
    _app, url, _shared = remote
    cfg = {"no base_url": _llm(None), "wrong key": _llm(url),
           "unserved model": _llm(url, model="gpt-4o"),
           "nothing listening": _llm(f"http://127.0.0.1:{_free_port()}/v1", timeout_s=2)}[case]
    if case == "wrong key":
        monkeypatch.setenv(KEY_ENV, "nope")
    with pytest.raises(RemoteLLMError, match=reason):
        await _connect(cfg)


async def test_a_reply_is_the_engines_with_client_timing_and_the_servers_speculation(remote):
    _app, url, shared = remote
    sampling = SamplingConfig(max_new_tokens=24, temperature=0.0)
    chat = await _connect(_llm(url, name="remote-ngram"), sampling)
    direct = await shared.worker.generate(encode_chat(shared.llm.target.tokenizer, HELLO),
                                          sampling=sampling)
    handle = chat.submit(HELLO, None, "call-1", None)  # None: the backend's default sampling
    deltas = [delta.text async for delta in handle]
    done = await handle.result()
    stats = done.stats
    assert "".join(deltas) == done.text == direct.text
    assert stats.method == "remote-ngram"  # how the dashboard tells backends apart
    assert stats.generated_tokens == len(direct.token_ids)
    assert len(stats.token_times_ms) == stats.generated_tokens  # each token timed, bursts too
    assert stats.ttft_ms is not None and stats.ttft_ms > 0
    assert stats.steps and stats.k_history  # the server's own per-request speculation, kept
    assert stats.drafted == direct.stats.drafted


async def test_a_required_tool_call_comes_back_as_the_completions_call(remote):
    _app, url, _shared = remote
    order = {"type": "function", "function": {"name": "lookup_order", "parameters": {
        "type": "object", "required": ["order_id"],
        "properties": {"order_id": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
    chat = await _connect(_llm(url), SamplingConfig(max_new_tokens=200))
    handle = chat.submit(HELLO, None, "call-1", None, ToolUse([order], ("lookup_order",)))
    spoken = [delta.text async for delta in handle]
    done = await handle.result()
    [call] = done.tool_calls
    assert spoken == [] and done.finish_reason == "eos"
    assert call["name"] == "lookup_order" and call["id"]
    assert re.fullmatch("[0-9]{5}", call["arguments"]["order_id"])


async def test_cancel_closes_the_stream_and_the_server_stops_generating(slow_remote):
    app, url, shared = slow_remote
    chat = await _connect(_llm(url), SamplingConfig(max_new_tokens=2000, temperature=0.0))
    handle = chat.submit(HELLO, None, "call-2", None)
    async for _delta in handle:
        break  # the first text arrived: the bot is speaking; the caller barges in
    handle.cancel()
    done = await handle.result()
    server = app.state.server
    assert done.finish_reason == "cancelled"
    assert done.stats.cancel_to_stop_ms is None  # the server's stop is not seen from here
    assert await until(lambda: shared.worker.in_flight == 0, 5), "the server kept generating"
    assert all(h.done for h in server.api_handles)
    (served,) = [await h.result() for h in server.api_handles]
    assert served.finish_reason == "cancelled" and len(served.token_ids) < 2000


async def test_barge_in_on_the_pipeline_service_cancels_the_remote_request(slow_remote):
    _app, url, shared = slow_remote
    chat = await _connect(_llm(url), SamplingConfig(max_new_tokens=2000, temperature=0.0))
    llm = ChatLLMService(chat, session_id="call-3")
    context = LLMContext(messages=HELLO)
    frames = [LLMContextFrame(context=context), SleepFrame(sleep=1.5), InterruptionFrame(),
              SleepFrame(sleep=0.5)]
    down, _up = await asyncio.wait_for(run_test(llm, frames_to_send=frames), 60)
    (stats,) = [d for f in down if isinstance(f, MetricsFrame) for d in f.data
                if isinstance(d, EngineStatsMetricsData)]
    assert any(isinstance(f, LLMTextFrame) for f in down)
    assert stats.interrupted and stats.finish_reason == "cancelled"
    assert stats.stats.method == "voiceagent"
    assert await until(lambda: shared.worker.in_flight == 0, 5), "the server kept generating"


async def test_the_dashboard_names_the_remote_and_its_unknown_speculation(remote, tmp_path):
    _app, url, _shared = remote
    chat = await _connect(_llm(url, name="box-2"))
    front = SharedModels(llm=None, worker=None, chat=chat)
    cfg = server_config(tmp_path, "llm.backend=openai", f"llm.base_url={url}")
    async with serving(cfg, front) as (_front_app, base):
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            info = (await http.get("/api/backend")).json()
            card = await http.get("/api/pair-card")
            models = (await http.get("/v1/models")).json()
    assert (info["backend"], info["model"], info["name"]) == ("openai", MODEL, "box-2")
    # Our /v1's /metrics has no vLLM counters: unknown, not zero (per-turn stats carry ours).
    assert info["metrics_url"] == url.removesuffix("/v1") + "/metrics"
    assert info["speculation"] is None
    # ... read, not refused: the page answered, with the key, and had no vLLM counters.
    async with httpx.AsyncClient(timeout=30, headers={"Authorization": "Bearer s3cret"}) as http:
        page = await http.get(info["metrics_url"])
    assert page.status_code == 200 and "vllm:" not in page.text
    assert card.status_code == 404 and "remote" in card.json()["detail"]
    assert models["data"] == []  # no in-process engine to serve


@contextmanager
def _fixed_page(body: bytes, content_type: str) -> Iterator[str]:
    """A real HTTP server on a loopback port answering every GET or POST with `body`; yields
    its root URL."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.do_GET()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.fixture
def vllm_metrics_page():
    """vLLM's own /metrics text (captured from its CPU build with ngram speculation on)."""
    body = (Path(__file__).parent / "data" / "vllm_metrics.txt").read_bytes()
    with _fixed_page(body, "text/plain; version=0.0.4") as root:
        yield f"{root}/metrics"


async def test_vllms_speculation_counters_give_its_acceptance(vllm_metrics_page):
    got = await speculation_counters(vllm_metrics_page, {})
    assert (got["drafts"], got["draft_tokens"], got["accepted_tokens"]) == (17, 68, 49)
    assert got["acceptance_rate"] == pytest.approx(49 / 68)
    assert got["mean_accepted_per_draft"] == pytest.approx(49 / 17)
    assert got["accepted_by_position"] == pytest.approx([14 / 17, 12 / 17, 12 / 17, 11 / 17])


async def test_healthz_is_degraded_while_the_remotes_requests_fail(remote, tmp_path):
    _app, url, _shared = remote
    chat = await _connect(_llm(url), SamplingConfig(max_new_tokens=4))
    front = SharedModels(llm=None, worker=None, chat=chat)
    cfg = server_config(tmp_path, "llm.backend=openai", f"llm.base_url={url}")
    async with serving(cfg, front) as (_front_app, base):
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            chat.model = "gone"  # as if the server stopped serving it
            failed = await chat.submit(HELLO, None, "call-4", None).result()
            degraded = (await http.get("/healthz")).json()
            chat.model = MODEL
            await chat.submit(HELLO, None, "call-4", None).result()
            healthy = (await http.get("/healthz")).json()
    assert failed.finish_reason == "error" and "NotFoundError" in failed.error
    assert degraded["status"] == "degraded" and "NotFoundError" in degraded["llm"]["last_error"]
    assert healthy["status"] == "ready" and healthy["llm"]["last_error"] is None


async def test_a_request_cancelled_before_it_starts_still_ends(remote):
    _app, url, _shared = remote
    chat = await _connect(_llm(url))
    handle = chat.submit(HELLO, None, "call-5", None)
    handle.cancel()  # same loop turn as the submit: the task never ran
    done = await asyncio.wait_for(handle.result(), 2)
    assert done.finish_reason == "cancelled"


@pytest.fixture
def cut_stream():
    """A server whose chat stream sends text and then closes without a finish reason."""
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]}
    body = f"data: {json.dumps(chunk)}\n\n".encode()
    with _fixed_page(body, "text/event-stream") as root:
        yield f"{root}/v1"


async def test_a_stream_cut_short_is_an_error_not_a_finished_reply(cut_stream):
    chat = RemoteChat(_llm(cut_stream), "m", "cut", SamplingConfig())
    done = await asyncio.wait_for(chat.submit(HELLO, None, "call-6", None).result(), 10)
    assert done.text == "Hello"
    assert done.finish_reason == "error" and "without a finish reason" in done.error
    assert chat.last_error == done.error
