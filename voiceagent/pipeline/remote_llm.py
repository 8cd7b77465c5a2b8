"""The pipeline's LLM on a remote OpenAI-compatible server: vLLM, SGLang, llama.cpp's server, or
another `voiceagent serve` (its `/v1`).

Requests go over the chat-completions stream of the official `openai` client. The clocks are
measured here, on the client, as for the in-process engine: time to first token from submit to
the first text, one inter-token latency per token. A chunk's token count comes from the running
usage that `stream_options.continuous_usage_stats` asks for (vLLM, SGLang and our `/v1` send it),
so a speculative server's multi-token chunks count as bursts; from a server that ignores it each
text chunk counts as one token, and the final usage corrects the total.

Speculation: our `/v1` reports each request's steps, K and acceptance in its `voiceagent` field,
kept here with the client's own timing. vLLM reports speculation only server-wide, in Prometheus
counters (`vllm:spec_decode_*`), which `speculation_counters` reads for the dashboard.

Barge-in: `cancel()` cancels the task reading the stream, which closes the HTTP response; the
server sees the disconnect and stops generating (vLLM aborts the request; our `/v1` cancels it at
the engine's next step).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import openai
from loguru import logger
from prometheus_client.parser import text_string_to_metric_families

from llm_engine.config import SamplingConfig
from llm_engine.serving import Completion, DeltaStream, TextDelta
from llm_engine.stats import RequestStats
from voiceagent.config import LLMConfig
from voiceagent.pipeline.chat_backend import ToolUse
from voiceagent.urls import redact

# Timing is the client's own; everything else a server's per-request stats say is kept.
_CLIENT_TIMING = ("method", "ttft_ms", "itl_ms", "token_times_ms", "total_ms",
                  "cancel_to_stop_ms", "finish_reason", "generated_tokens")
# vLLM's speculation counters (Prometheus names, `_total` suffix included).
_VLLM_SPEC = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}
_VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


class RemoteLLMError(RuntimeError):
    """The remote server can't be used as configured; the message says why and what to set."""


def _client_args(cfg: LLMConfig) -> dict:
    # Servers started without a key accept any; the client insists on a non-empty one.
    return {"base_url": cfg.base_url, "api_key": os.environ.get(cfg.api_key_env) or "none",
            "timeout": cfg.timeout_s, "max_retries": 0}


def connect(cfg: LLMConfig, sampling: SamplingConfig) -> RemoteChat:
    """Check the server answers and serves the model (the only one when `llm.model` is unset);
    raises RemoteLLMError with the reason. `sampling`: the default of requests that set none.
    Blocking: call it at start-up, off the event loop."""
    if not cfg.base_url:
        raise RemoteLLMError("llm.backend is openai but llm.base_url is not set "
                             "(e.g. --set llm.base_url=http://127.0.0.1:8000/v1)")
    where = redact(cfg.base_url)
    client = openai.OpenAI(**_client_args(cfg))
    try:
        served = {m.id: m for m in client.models.list()}
    except openai.AuthenticationError:
        raise RemoteLLMError(f"{where} refused the API key: set it in the environment "
                             f"variable {cfg.api_key_env}") from None
    except openai.APIError as exc:
        raise RemoteLLMError(f"the LLM server at {where} did not answer /models: "
                             f"{type(exc).__name__}") from None
    finally:
        client.close()
    if cfg.model is None and len(served) != 1:
        raise RemoteLLMError(f"{where} serves {sorted(served) or 'no models'}: "
                             "choose one with llm.model")
    model = cfg.model or next(iter(served))
    if model not in served:
        raise RemoteLLMError(f"{where} does not serve {model!r}; it serves {sorted(served)}")
    owner = getattr(served[model], "owned_by", None) or "remote"
    return RemoteChat(cfg, model, cfg.name or owner, sampling)


def metrics_url(cfg: LLMConfig) -> str | None:
    """Where the server's Prometheus text is: `llm.metrics_url`, else /metrics at the root of
    `llm.base_url` (vLLM's and SGLang's place)."""
    if cfg.metrics_url or not cfg.base_url:
        return cfg.metrics_url
    parts = urlsplit(cfg.base_url)
    return urlunsplit((parts.scheme, parts.netloc, "/metrics", "", ""))


async def speculation_counters(url: str, headers: dict[str, str],
                               timeout_s: float = 2.0) -> dict | None:
    """vLLM's server-wide speculation counters read from its Prometheus text, with the acceptance
    rate and the mean tokens accepted per draft; None when the server exposes none (or the page
    can't be read: the dashboard shows that as unknown, never as zero)."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            response = await http.get(url, headers=headers)
        response.raise_for_status()
        # Hundreds of kB of histograms: parsed off the event loop that carries the calls' audio.
        families = await asyncio.to_thread(
            lambda: list(text_string_to_metric_families(response.text)))
    except (httpx.HTTPError, ValueError) as exc:
        logger.debug(f"no speculation counters from {redact(url)}: {type(exc).__name__}")
        return None
    found: dict[str, float] = {}
    by_position: dict[int, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name in _VLLM_SPEC:  # summed over engines and models
                key = _VLLM_SPEC[sample.name]
                found[key] = found.get(key, 0.0) + sample.value
            elif sample.name == _VLLM_PER_POSITION:
                position = int(sample.labels.get("position", 0))
                by_position[position] = by_position.get(position, 0.0) + sample.value
    if "draft_tokens" not in found:
        return None
    drafted, accepted = found["draft_tokens"], found.get("accepted_tokens", 0.0)
    drafts = found.get("drafts", 0.0)
    return {**found, "source": url,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_per_draft": accepted / drafts if drafts else None,
            # Of the drafts, the share accepted at each draft position.
            "accepted_by_position": [by_position[p] / drafts if drafts else None
                                     for p in sorted(by_position)]}


class RemoteChat:
    """`ChatBackend` over a remote server's chat-completions stream (see the module doc)."""

    def __init__(self, cfg: LLMConfig, model: str, name: str, sampling: SamplingConfig):
        self.cfg, self.model, self.name, self.sampling = cfg, model, name, sampling
        self.metrics_url = metrics_url(cfg)
        # Why the last request failed; None once one succeeds again (`/healthz` shows it).
        self.last_error: str | None = None
        self._counters: tuple[float, dict | None] | None = None  # (read at, counters)
        self._client: openai.AsyncOpenAI | None = None  # made on the event loop that uses it

    @property
    def client(self) -> openai.AsyncOpenAI:
        if self._client is None:
            self._client = openai.AsyncOpenAI(**_client_args(self.cfg))
        return self._client

    async def speculation(self, max_age_s: float = 0.0) -> dict | None:
        """The server's speculation counters (`speculation_counters`), or None; a reading at
        most `max_age_s` old is reused (every open dashboard asks). The API key goes along only
        to the API's own host."""
        if not self.metrics_url:
            return None
        if self._counters and time.monotonic() - self._counters[0] <= max_age_s:
            return self._counters[1]
        same_host = urlsplit(self.metrics_url).netloc == urlsplit(self.cfg.base_url).netloc
        key = _client_args(self.cfg)["api_key"]
        counters = await speculation_counters(
            self.metrics_url, {"Authorization": f"Bearer {key}"} if same_host else {})
        self._counters = (time.monotonic(), counters)
        return counters

    def submit(self, messages: list[dict[str, Any]], sampling: SamplingConfig | None,
               session_id: str, method: str | None, tools: ToolUse | None = None,
               prefill: bool = False) -> RemoteHandle:
        # `method` picks a local proposer; the remote server's speculation is its own, and so is
        # its prefix cache (`prefill` sends the request all the same).
        if not messages:
            raise ValueError("empty prompt")
        return RemoteHandle(self, messages, sampling or self.sampling, session_id, tools)

    def drop_session(self, session_id: str) -> None:
        """Nothing to free here: a server's prefix cache (vLLM's, our /v1's) manages itself."""

    def request_args(self, messages: list[dict[str, Any]], sampling: SamplingConfig,
                     session_id: str, tools: ToolUse | None = None) -> dict:
        args: dict = {"model": self.model, "messages": messages, "stream": True,
                      "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                      "top_p": sampling.top_p,
                      # OpenAI's end-user id: our /v1 keys its per-session prefix cache on it.
                      "user": session_id,
                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if sampling.seed is not None:
            args["seed"] = sampling.seed
        if sampling.stop:
            args["stop"] = list(sampling.stop)
        if sampling.top_k:
            args["extra_body"] = {"top_k": sampling.top_k}  # vLLM and SGLang take it
        if tools is not None:
            args["tools"] = tools.tools
            args["tool_choice"] = _tool_choice(tools)
        return args


def _tool_choice(tools: ToolUse) -> str | dict:
    if tools.allowed and len(tools.required) == 1:
        return {"type": "function", "function": {"name": tools.required[0]}}
    return tools.choice


class RemoteHandle(DeltaStream):
    """One remote request: iterate it for `TextDelta`s, `cancel()` it, await `result()`."""

    def __init__(self, backend: RemoteChat, messages: list[dict[str, Any]],
                 sampling: SamplingConfig, session_id: str, tools: ToolUse | None = None):
        super().__init__(asyncio.get_running_loop())
        self._backend = backend
        self._args = backend.request_args(messages, sampling, session_id, tools)
        self._text: list[str] = []
        self._calls: dict[int, dict] = {}  # streamed tool calls by index: id, name, arguments
        self._t0 = time.perf_counter()
        self.stats = RequestStats(method=backend.name)
        self._task = asyncio.create_task(self._run(), name=f"remote-llm-{session_id}")
        # A task cancelled before its first step never enters `_run`'s try: end the handle here.
        self._task.add_done_callback(lambda _task: self._finish("cancelled", None, None, None))

    def cancel(self) -> None:
        if not self._task.done():
            self._task.cancel()

    def _ms(self) -> float:
        return (time.perf_counter() - self._t0) * 1000

    async def _run(self) -> None:
        reason, error, server_stats, usage = None, None, None, None
        try:
            stream = await self._backend.client.chat.completions.create(**self._args)
            async with stream:  # leaving it closes the response: the server stops generating
                seen = 0
                async for chunk in stream:
                    usage = chunk.usage or usage
                    server_stats = (chunk.model_extra or {}).get("voiceagent") or server_stats
                    for choice in chunk.choices:
                        text = choice.delta.content or ""
                        self._add_call_parts(choice.delta.tool_calls or [])
                        reason = choice.finish_reason or reason
                        tokens = (chunk.usage.completion_tokens - seen if chunk.usage
                                  else int(bool(text)))
                        if tokens > 0:
                            self.stats.record_tokens(tokens, self._ms())
                            seen += tokens
                        if text:
                            self._text.append(text)
                            self._queue.put_nowait(TextDelta(text, [], time.perf_counter()))
            if reason is None:  # cut short: a proxy's timeout, a server gone mid-reply
                reason, error = "error", "the stream ended without a finish reason"
            # OpenAI's "stop" is the model's end or a stop string; ours says "eos" for both,
            # and a tool call ends the reply as the model's end does.
            reason = {"stop": "eos", "tool_calls": "eos"}.get(reason, reason)
        except asyncio.CancelledError:
            reason = "cancelled"
        except Exception as exc:  # noqa: BLE001 - a failed request must end its handle, not hang it
            reason, error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            self._finish(reason or "error", error, server_stats, usage)

    def _add_call_parts(self, parts) -> None:
        # OpenAI streams a call as its id and name, then its arguments' JSON in pieces.
        for part in parts:
            call = self._calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            if part.function is not None:
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""

    def _tool_calls(self) -> list[dict]:
        calls = []
        for call in self._calls.values():
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except json.JSONDecodeError:
                arguments = None  # not JSON: `Tool.run` reports it to the model
            calls.append({"id": call["id"], "name": call["name"], "arguments": arguments})
        return calls

    def _finish(self, reason: str, error: str | None, server_stats: dict | None, usage) -> None:
        if self._completion.done():  # ended already (the done callback comes after `_run`)
            return
        stats = self.stats
        stats.prefill_ms = None  # the server's own business: unknown here, not 0
        if server_stats:  # our /v1: its speculation, with this client's timing
            timing = {name: getattr(stats, name) for name in _CLIENT_TIMING}
            try:
                stats = RequestStats.from_dict({**server_stats, **timing})
            except (TypeError, ValueError) as exc:  # another version's stats: keep our own
                logger.debug(f"unreadable server stats: {exc}")
        if usage is not None:
            stats.prompt_tokens = usage.prompt_tokens
            # The server's count wins; the tokens it counted beyond ours have no time of their own.
            stats.generated_tokens = max(stats.generated_tokens, usage.completion_tokens)
        stats.finish_reason = reason
        stats.total_ms = self._ms()
        # When the server stopped after a cancel is not observable from here.
        stats.cancel_to_stop_ms = None
        self.stats = stats
        if error is not None:
            self._backend.last_error = error
        elif reason != "cancelled":
            self._backend.last_error = None
        self._queue.put_nowait(self.END)
        if not self._completion.done():
            self._completion.set_result(
                Completion("".join(self._text), [], reason, stats, error,
                           self._tool_calls() if reason != "cancelled" else []))
