"""A backend that fails over: the primary serves each request unless it fails before its first
token (refused connection, a server error, a worker that is down) or gives none within
`llm.first_token_timeout_s`; then `llm.fallback` (a second OpenAI-compatible server, or the
in-process engine) serves that request from the start. The caller hears a reply a little late
instead of nothing for `llm.timeout_s`.

A request that has begun to speak stays with the primary: its text cannot be taken back. After
a failure the primary is skipped for `retry_primary_s` (a circuit breaker), so the turns that
follow do not each wait out the timeout; then the next request tries it again. Each request's
stats carry the method of the backend that served it, which is what the dashboard shows for the
turn.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from loguru import logger

from llm_engine.config import SamplingConfig
from llm_engine.serving import Completion, DeltaStream
from llm_engine.stats import RequestStats
from voiceagent.pipeline.chat_backend import ChatBackend, ChatHandle, ToolUse

RETRY_PRIMARY_S = 30.0  # after a failover, the primary is tried again this much later


class FailoverChat:
    """`ChatBackend` over a primary and a fallback backend."""

    def __init__(self, primary: ChatBackend, fallback: ChatBackend, first_token_timeout_s: float,
                 retry_primary_s: float = RETRY_PRIMARY_S):
        self.primary, self.fallback = primary, fallback
        self.first_token_timeout_s = first_token_timeout_s
        self.retry_primary_s = retry_primary_s
        self.failovers = 0  # requests the fallback served
        self.skip_primary_until = 0.0  # time.monotonic(): the breaker is open until then
        self.primary_error: str | None = None  # why the primary last failed over; None once it
        # serves again

    @property
    def model(self) -> str:
        return self.primary.model

    @property
    def name(self) -> str:
        return self.primary.name

    @property
    def last_error(self) -> str | None:
        """Why the primary last failed, until it serves again (`/healthz` says degraded while
        it stands): a hang cancelled by the timeout is a failure here, not on the primary."""
        return self.primary_error or getattr(self.primary, "last_error", None)

    def submit(self, messages: list[dict[str, Any]], sampling: SamplingConfig | None,
               session_id: str, method: str | None, tools: ToolUse | None = None,
               prefill: bool = False) -> ChatHandle:
        return FailoverHandle(self, (messages, sampling, session_id, method, tools, prefill))

    def drop_session(self, session_id: str) -> None:
        self.primary.drop_session(session_id)
        self.fallback.drop_session(session_id)


class FailoverHandle(DeltaStream):
    """One request: the primary's deltas, or the fallback's when the primary failed first."""

    def __init__(self, chat: FailoverChat, request: tuple):
        super().__init__(asyncio.get_running_loop())
        self._chat, self._request = chat, request
        self.failover: str | None = None  # why the fallback served it
        self._current: ChatHandle | None = None
        if time.monotonic() < chat.skip_primary_until:
            self.failover = "the primary failed lately"
        else:
            try:
                self._current = chat.primary.submit(*request)
            except RuntimeError as exc:  # the primary is down (a dead engine worker)
                self.failover = str(exc)
        self._task = asyncio.create_task(self._run(), name=f"failover-{request[2]}")

    def cancel(self) -> None:
        if self._current is not None:
            self._current.cancel()
        self._task.cancel()

    async def _run(self) -> None:
        try:
            completion = await self._relay()
        except asyncio.CancelledError:
            completion = (await self._current.result() if self._current is not None
                          else self._failed("cancelled", None))
        except Exception as exc:  # noqa: BLE001 - the handle must end, not hang
            completion = self._failed("error", f"{type(exc).__name__}: {exc}")
        self._queue.put_nowait(self.END)
        self._completion.set_result(completion)

    async def _relay(self) -> Completion:
        primary = self._current
        if primary is not None:
            try:
                first = await asyncio.wait_for(anext(primary), self._chat.first_token_timeout_s)
            except TimeoutError:  # waiting cancelled the primary
                self.failover = f"no first token in {self._chat.first_token_timeout_s:g} s"
            except StopAsyncIteration:
                completion = await primary.result()
                if completion.finish_reason not in ("error", "cancelled"):
                    self._chat.primary_error = None  # it serves again
                if completion.finish_reason != "error":
                    return completion  # e.g. a tool call, which streams no text
                self.failover = completion.error or "the primary failed"
            else:
                self._chat.primary_error = None
                self._queue.put_nowait(first)
                return await self._forward(primary)
        self._chat.failovers += 1
        if primary is not None:  # it failed just now: skip it for a while
            self._chat.skip_primary_until = time.monotonic() + self._chat.retry_primary_s
            self._chat.primary_error = self.failover
        logger.warning(f"LLM primary failed before its first token ({self.failover}): "
                       f"the fallback ({self._chat.fallback.name}) serves this request")
        self._current = self._chat.fallback.submit(*self._request)
        return await self._forward(self._current)

    async def _forward(self, handle: ChatHandle) -> Completion:
        async for delta in handle:
            self._queue.put_nowait(delta)
        return await handle.result()

    def _failed(self, reason: str, error: str | None) -> Completion:
        stats = RequestStats(method=self._chat.name)
        stats.finish_reason = reason
        return Completion("", [], reason, stats, error)
