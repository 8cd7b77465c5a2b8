"""The call's tools: which ones each request may call (`ToolPolicy`), and the tools as pipecat
function handlers on the call's LLM service.

`ToolPolicy` decides for the call's service and the echo bench alike, and lists every tool use it
can return, so that start-up compiles exactly those grammars and no call compiles one.

Each configured tool (voiceagent.tools) is registered with `LLMService.register_function`, so a
tool call travels pipecat's own flow (llm_service.py's module doc). The handler adds what a call
on the phone needs around `Tool.run`: a spoken filler when the tool is still running after
`agent.tool_filler_after_s` (silence on a phone line sounds like a dropped call), and the hang-up
after the goodbye for a tool that ends the call: `agent.goodbye`, or when that is empty the model's
reply to the tool's result. A failing tool's result says so, for the model to apologise from; the
call goes on. A read-only tool may run on a prepared reply before its turn is confirmed
(`register_early`), so its result is ready at commit; a tool with a `say` template speaks its
result at once, without a second request to the model.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipecat.frames.frames import FunctionCallResultProperties, TTSSpeakFrame
from pipecat.services.llm_service import FunctionCallParams

from voiceagent.config import AgentConfig
from voiceagent.pipeline.chat_backend import ToolUse
from voiceagent.tools import Tool, ToolResult

if TYPE_CHECKING:
    from voiceagent.pipeline.llm_service import ChatLLMService

# A spoken reply has no markup. A small model answering a tool's result copies the call's, and
# one that may call writes a call's JSON as words ("You can call this service: {"name": ...").
# Where a call may follow, only "{": the call itself begins with "<".
_MARKUP = ("<", "{")
_CALL_IN_WORDS = ("{",)


@dataclass(frozen=True)
class ToolPolicy:
    """What each request of a turn may call: every tool is shown; a call is required when the
    caller's words match some tools' triggers; once the turn has made `max_calls` calls, the
    reply must be words (a small model would call again and again)."""

    tools: tuple[Tool, ...]
    max_calls: int = 1

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools]

    def first(self, words: str) -> ToolUse:
        """The turn's first request, on the caller's words."""
        required = tuple(t.name for t in self.tools if t.triggered_by(words))
        return ToolUse(self.schemas, required) if required else self.after(0)

    def after(self, calls: int) -> ToolUse:
        """A request after the turn's `calls` tool calls and their results."""
        if calls < self.max_calls:
            return ToolUse(self.schemas, exclude=_CALL_IN_WORDS)
        return ToolUse(self.schemas, allowed=False, exclude=_MARKUP)

    def for_messages(self, messages: list[dict[str, Any]]) -> ToolUse | None:
        """The request on this conversation: after the caller's words, or after tool results."""
        if not self.tools:
            return None
        last = messages[-1] if messages else {}
        if last.get("role") == "user":
            return self.first(last.get("content") or "")
        turn = messages[max((i for i, m in enumerate(messages) if m["role"] == "user"),
                            default=-1) + 1:]
        return self.after(sum(len(m.get("tool_calls") or ()) for m in turn))

    def every_use(self) -> list[ToolUse]:
        """Every tool use the methods above can return: the grammars to compile at start-up
        (with n tools that have triggers, 2^n - 1 required sets)."""
        if not self.tools:
            return []
        triggered = [t.name for t in self.tools if t.triggers]
        required = [combo for n in range(1, len(triggered) + 1)
                    for combo in itertools.combinations(triggered, n)]
        return [self.after(0), self.after(self.max_calls),
                *(ToolUse(self.schemas, combo) for combo in required)]


def register_tools(llm: ChatLLMService, tools: Sequence[Tool], agent: AgentConfig) -> None:
    for tool in tools:
        # cancel_on_interruption: a caller who barges in has moved on; the call's result would
        # answer a question nobody is waiting for.
        llm.register_function(tool.name, _handler(llm, tool, agent), cancel_on_interruption=True)
        if tool.read_only:
            llm.register_early(tool.name, _early_run(tool, agent))


def _early_run(tool: Tool, agent: AgentConfig):
    async def run(arguments: dict) -> ToolResult:
        return await tool.run(arguments, agent.tool_timeout_s)

    return run


def _handler(llm: ChatLLMService, tool: Tool, agent: AgentConfig):
    async def handle(params: FunctionCallParams) -> None:
        early = llm.take_early(params.tool_call_id)  # run while the turn was being confirmed
        filler = llm.create_task(_filler(llm, agent), f"filler-{params.tool_call_id}")
        try:
            result = await (early or tool.run(dict(params.arguments), agent.tool_timeout_s))
        finally:
            await llm.cancel_task(filler)
        spoken = tool.spoken(result) if agent.tool_templates else None
        if spoken is not None and not tool.ends_call:
            # The template is the answer: spoken at once, no second request to the model.
            await params.result_callback(
                result.content, properties=FunctionCallResultProperties(run_llm=False))
            await llm.say_reply(spoken)
            return
        if tool.ends_call and result.ok and agent.goodbye:
            await params.result_callback(
                result.content, properties=FunctionCallResultProperties(run_llm=False))
            await llm.hang_up(agent.goodbye)
            return
        if tool.ends_call and result.ok:
            llm.end_after_reply()
        await params.result_callback(result.content)

    return handle


async def _filler(llm: ChatLLMService, agent: AgentConfig) -> None:
    if not agent.tool_filler:
        return
    await asyncio.sleep(agent.tool_filler_after_s)
    await llm.push_frame(TTSSpeakFrame(agent.tool_filler))
