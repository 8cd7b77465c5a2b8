"""The call's tools as pipecat function handlers on its LLM service.

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
from collections.abc import Sequence

from pipecat.frames.frames import FunctionCallResultProperties, TTSSpeakFrame
from pipecat.services.llm_service import FunctionCallParams

from voiceagent.config import AgentConfig
from voiceagent.pipeline.llm_service import SpeculativeLLMService
from voiceagent.tools import Tool, ToolResult


def register_tools(llm: SpeculativeLLMService, tools: Sequence[Tool], agent: AgentConfig) -> None:
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


def _handler(llm: SpeculativeLLMService, tool: Tool, agent: AgentConfig):
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


async def _filler(llm: SpeculativeLLMService, agent: AgentConfig) -> None:
    if not agent.tool_filler:
        return
    await asyncio.sleep(agent.tool_filler_after_s)
    await llm.push_frame(TTSSpeakFrame(agent.tool_filler))
