"""Tool calls in a call: ChatLLMService with its tools registered (tool_calls.py) and the
assistant aggregator, in pipecat's run_test harness on a tiny random-weight engine. A turn whose
words match a tool's trigger requires a call of that tool, so the random model's reply is a valid
call whatever its weights (the tools grammar)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from pipecat.frames.frames import (
    EagerEndOfTurnCancelFrame,
    EndWorkerFrame,
    FunctionCallInProgressFrame,
    FunctionCallResultFrame,
    InterruptionFrame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMTextFrame,
    TTSSpeakFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMAssistantAggregator
from pipecat.processors.frame_processor import Frame, FrameDirection, FrameProcessor
from pipecat.tests.utils import SleepFrame, run_test

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.grammar import TOOL_CALL_BEGIN
from tests.voiceagent.scripted_engine import RecordingAsyncEngine, ScriptedEngine
from voiceagent.config import AgentConfig
from voiceagent.pipeline.chat_backend import EngineChat
from voiceagent.pipeline.llm_service import ChatLLMService
from voiceagent.pipeline.tool_calls import ToolPolicy, register_tools
from voiceagent.tools import load_tools

RUNS: list[tuple[str, dict]] = []  # what the test handlers were called with


async def record_order(order_id: str) -> dict:
    RUNS.append(("record_order", {"order_id": order_id}))
    return {"order_id": order_id, "status": "shipped"}


async def peek_order(order_id: str) -> dict:
    RUNS.append(("peek_order", {"order_id": order_id}))
    return {"order_id": order_id, "status": "shipped"}


async def slow_check(order_id: str) -> dict:
    RUNS.append(("slow_check", {"order_id": order_id}))
    await asyncio.sleep(1.0)
    return {"status": "ready"}


async def broken(order_id: str) -> dict:
    RUNS.append(("broken", {"order_id": order_id}))
    raise ConnectionError("orders database unreachable")


async def hang_up(reason: str = "") -> dict:
    RUNS.append(("hang_up", {"reason": reason}))
    return {"ending": True}


def _tool(name: str, trigger: str, **extra) -> dict:
    return {"name": name, "description": f"the {name} tool", "triggers": [trigger],
            "handler": f"tests.voiceagent.test_tool_calls:{name}",
            "parameters": {"type": "object", "required": ["order_id"], "properties": {
                "order_id": {"type": "string", "pattern": "^[0-9]{5}$"}}}, **extra}


TOOLS = load_tools([
    _tool("record_order", r"\border\b"),
    _tool("slow_check", r"\bslow\b"),
    _tool("broken", r"\bbroken\b"),
    _tool("peek_order", r"\bpeek\b", read_only=True),
    {"name": "hang_up", "handler": "tests.voiceagent.test_tool_calls:hang_up", "ends_call": True,
     "triggers": [r"\bbye\b"], "parameters": {"type": "object", "properties": {}}},
])


@pytest.fixture(autouse=True)
def _clear_runs():
    RUNS.clear()


@pytest.fixture
def make_serving(model, tokenizer):
    servings = []

    def make(**scripted) -> RecordingAsyncEngine:
        config = EngineConfig(speculation=SpeculationConfig(method="ngram", gate=False),
                              sampling=SamplingConfig(max_new_tokens=128))
        # With EOS: a tool call's grammar ends the reply when the call is complete.
        engine = ScriptedEngine(model, tokenizer, config,
                                eos_token_ids={tokenizer.eos_token_id}, **scripted)
        servings.append(RecordingAsyncEngine(engine))
        return servings[-1]

    yield make
    for serving in servings:
        serving.close()


class Probe(FrameProcessor):
    """Between the LLM and the assistant aggregator (which consumes the reply and function-call
    frames): keeps what passes downstream, in order, and what had run at the turn's commit."""

    def __init__(self):
        super().__init__()
        self.frames: list[Frame] = []
        self.runs_at_commit: list | None = None

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.frames.append(frame)
            if isinstance(frame, UserStoppedSpeakingFrame):
                self.runs_at_commit = list(RUNS)
        await self.push_frame(frame, direction)


async def _run(serving, tokenizer, context: LLMContext, frames: list, system_prompt="Be brief.",
               tools=TOOLS, **agent) -> Probe:
    llm = ChatLLMService(EngineChat(serving, tokenizer), session_id="call-1",
                                system_prompt=system_prompt, tools=ToolPolicy(tuple(tools)))
    register_tools(llm, tools, AgentConfig(**{"tool_filler_after_s": 0.3, **agent}))
    probe = Probe()
    await asyncio.wait_for(
        run_test(Pipeline([llm, probe, LLMAssistantAggregator(context)]), frames_to_send=frames),
        60)
    return probe


def _user(context: LLMContext, text: str, speculation: bool = False) -> LLMContextFrame:
    context.add_message({"role": "user", "content": text})
    return LLMContextFrame(context=context, speculation=speculation)


def _of(frames, kind) -> list:
    return [f for f in frames if isinstance(f, kind)]


async def test_triggered_tool_runs_and_the_next_reply_is_prompted_with_its_result(
        make_serving, tokenizer):
    serving, context = make_serving(), LLMContext()
    probe = await _run(serving, tokenizer, context,
                       [_user(context, "Where is my order 48213?"), SleepFrame(sleep=3)])

    assert [name for name, _ in RUNS] == ["record_order"]
    [result] = _of(probe.frames, FunctionCallResultFrame)
    assert result.result["status"] == "shipped"
    call, tool = context.get_messages()[1:3]
    assert call["tool_calls"][0]["function"]["name"] == "record_order"
    assert tool["role"] == "tool" and json.loads(tool["content"])["status"] == "shipped"
    # The call's reply, then the reply from its result: prompted with the call and the result.
    _warmup, first, second = serving.handles
    assert (await first.result()).tool_calls[0]["name"] == "record_order"
    prompt = tokenizer.decode(second.state.prompt_ids)
    assert TOOL_CALL_BEGIN in prompt and 'Result of record_order: {"order_id"' in prompt


async def test_a_tool_call_is_never_spoken(make_serving, tokenizer):
    serving, context = make_serving(), LLMContext()
    probe = await _run(serving, tokenizer, context,
                       [_user(context, "Where is my order 48213?"), SleepFrame(sleep=2)])

    assert RUNS
    spoken = "".join(f.text for f in _of(probe.frames, LLMTextFrame))
    assert "<tool" not in spoken and "order_id" not in spoken


ORDER, PEEK = "Where is my order 48213?", "Peek at 48213 please"


async def _prepared_then(serving, tokenizer, said: str, then: Frame):
    """A reply prepared on `said`, then `then` (the turn confirmed, or withdrawn)."""
    context = LLMContext()
    probe = await _run(serving, tokenizer, context, [
        _user(context, said, speculation=True), SleepFrame(sleep=2), then, SleepFrame(sleep=2)])
    return probe, context


async def test_a_prepared_reply_runs_its_tool_only_once_the_turn_is_confirmed(
        make_serving, tokenizer):
    serving = make_serving()
    probe, context = await _prepared_then(serving, tokenizer, ORDER, UserStoppedSpeakingFrame())

    _warmup, prepared, *_ = serving.handles
    assert (await prepared.result()).tool_calls, "the prepared reply decided on a call"
    assert probe.runs_at_commit == [], "nothing ran before the turn was confirmed"
    assert [name for name, _ in RUNS] == ["record_order"]


async def test_a_withdrawn_prepared_reply_never_runs_its_tool(make_serving, tokenizer):
    serving = make_serving()
    probe, context = await _prepared_then(serving, tokenizer, ORDER, EagerEndOfTurnCancelFrame())

    _warmup, prepared = serving.handles
    assert (await prepared.result()).tool_calls, "the withdrawn reply had decided on a call"
    assert RUNS == [] and not _of(probe.frames, FunctionCallInProgressFrame)


async def test_a_read_only_tool_runs_on_the_prepared_reply_before_the_turn_is_confirmed(
        make_serving, tokenizer):
    serving = make_serving()
    probe, context = await _prepared_then(serving, tokenizer, PEEK, UserStoppedSpeakingFrame())

    assert [name for name, _ in probe.runs_at_commit] == ["peek_order"], "ran before commit"
    assert [name for name, _ in RUNS] == ["peek_order"], "and not again at commit"
    [result] = _of(probe.frames, FunctionCallResultFrame)
    assert result.result["status"] == "shipped"


async def test_a_withdrawn_prepared_reply_drops_its_read_only_result(make_serving, tokenizer):
    serving = make_serving()
    probe, context = await _prepared_then(serving, tokenizer, PEEK, EagerEndOfTurnCancelFrame())

    assert [name for name, _ in RUNS] == ["peek_order"], "it ran while the turn was open"
    assert not _of(probe.frames, FunctionCallResultFrame), "its result never reached the call"
    assert all(m["role"] != "tool" for m in context.get_messages())


async def test_a_tool_with_a_template_speaks_its_result_without_asking_the_model(
        make_serving, tokenizer):
    tools = [dataclasses.replace(t, say="Order {order_id!d} is {status}.")
             if t.name == "record_order" else t for t in TOOLS]
    serving, context = make_serving(), LLMContext()
    probe = await _run(serving, tokenizer, context,
                       [_user(context, "Where is my order 48213?"), SleepFrame(sleep=3)],
                       tools=tools)

    [result] = _of(probe.frames, FunctionCallResultFrame)
    said = f"Order {' '.join(result.result['order_id'])} is shipped."  # the model's digits
    spoken = "".join(f.text for f in _of(probe.frames, LLMTextFrame))
    assert spoken == said
    _warmup, call = serving.handles  # no request answered the result
    assert (await call.result()).tool_calls
    assert context.get_messages()[-1] == {"role": "assistant", "content": said}


async def test_an_interrupted_reply_never_runs_its_tool(make_serving, tokenizer):
    # No system prompt: no warm-up request, so the held first request is the reply.
    serving, context = make_serving(hold_first=True), LLMContext()
    probe = await _run(serving, tokenizer, context, [
        _user(context, "Where is my order 48213?"), SleepFrame(sleep=1.0), InterruptionFrame(),
        SleepFrame(sleep=1.0)], system_prompt=None)

    [reply] = serving.handles
    assert (await reply.result()).finish_reason == "cancelled"
    assert RUNS == [] and not _of(probe.frames, FunctionCallInProgressFrame)


async def test_a_failing_tool_becomes_a_result_and_the_call_goes_on(make_serving, tokenizer):
    serving, context = make_serving(), LLMContext()
    probe = await _run(serving, tokenizer, context,
                       [_user(context, "Is the broken one 48213 back?"), SleepFrame(sleep=3)])

    [result] = _of(probe.frames, FunctionCallResultFrame)
    assert "orders database unreachable" in result.result["error"]
    assert len(serving.handles) == 3, "the model is asked again, with the error to apologise from"
    assert (await serving.handles[2].result()).finish_reason in ("eos", "length")


async def test_a_slow_tool_says_the_filler_while_it_runs(make_serving, tokenizer):
    serving, context = make_serving(), LLMContext()
    probe = await _run(serving, tokenizer, context,
                       [_user(context, "Is the slow one 48213 ready?"), SleepFrame(sleep=3)],
                       tool_filler="Let me check.")

    [filler] = _of(probe.frames, TTSSpeakFrame)
    assert filler.text == "Let me check."
    [result] = _of(probe.frames, FunctionCallResultFrame)
    assert probe.frames.index(filler) < probe.frames.index(result)


async def test_a_quick_tool_says_no_filler(make_serving, tokenizer):
    serving, context = make_serving(), LLMContext()
    probe = await _run(serving, tokenizer, context,
                       [_user(context, "Where is my order 48213?"), SleepFrame(sleep=2)])

    assert RUNS and not _of(probe.frames, TTSSpeakFrame)


async def test_a_tool_that_ends_the_call_says_the_goodbye_then_hangs_up(make_serving, tokenizer):
    serving, context = make_serving(), LLMContext()
    probe = await _run(serving, tokenizer, context,
                       [_user(context, "Thanks, bye"), SleepFrame(sleep=2)], goodbye="Bye now!")

    assert [name for name, _ in RUNS] == ["hang_up"]
    [goodbye], [end] = _of(probe.frames, TTSSpeakFrame), _of(probe.frames, EndWorkerFrame)
    assert goodbye.text == "Bye now!"
    assert probe.frames.index(goodbye) < probe.frames.index(end), "the goodbye is queued first"
    assert len(serving.handles) == 2, "no reply to the tool's result: the goodbye is the reply"


async def test_without_a_goodbye_the_call_ends_after_the_models_reply(make_serving, tokenizer):
    serving, context = make_serving(), LLMContext()
    probe = await _run(serving, tokenizer, context,
                       [_user(context, "Thanks, bye"), SleepFrame(sleep=3)], goodbye="")

    assert [name for name, _ in RUNS] == ["hang_up"]
    [end] = _of(probe.frames, EndWorkerFrame)
    goodbye_end = _of(probe.frames, LLMFullResponseEndFrame)[-1]
    assert probe.frames.index(goodbye_end) < probe.frames.index(end), "goodbye queued first"
    assert len(serving.handles) == 3


async def test_once_the_turns_calls_are_used_the_reply_is_words_without_markup(
        make_serving, tokenizer):
    serving, context = make_serving(), LLMContext()
    await _run(serving, tokenizer, context,
               [_user(context, "Where is my order 48213?"), SleepFrame(sleep=3)])

    answer = await serving.handles[2].result()
    assert not answer.tool_calls
    assert not set(answer.text) & set("<{"), answer.text


async def test_a_call_is_drafted_through_the_grammar_whatever_the_calls_method(
        make_serving, tokenizer):
    serving, context = make_serving(), LLMContext()
    await _run(serving, tokenizer, context,
               [_user(context, "Where is my order 48213?"), SleepFrame(sleep=2)])

    call = (await serving.handles[1].result()).stats
    assert call.method == "grammar+ngram" and call.grammar_drafted > 0


# -- the tool policy ------------------------------------------------------------------------------


@pytest.mark.parametrize("words", ["Hello there.", "What can you do for me?"])
def test_a_reply_that_may_call_a_tool_never_writes_a_calls_json_as_words(words):
    policy = ToolPolicy(TOOLS, max_calls=2)
    called = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}
    result = {"role": "tool", "tool_call_id": "c", "content": "{}"}
    asked = [{"role": "user", "content": words}]
    for messages in (asked, [*asked, called, result]):
        use = policy.for_messages(messages)  # words or a call: nothing triggered, none made
        assert use.choice == "auto" and "{" in use.grammar().exclude


@pytest.mark.parametrize("words", ["Hello there.", "Where is my order 48213?",
                                   "A slow order, and then bye.", "peek broken slow order bye"])
def test_every_tool_use_the_policy_decides_is_one_it_lists_for_start_up(words):
    policy = ToolPolicy(TOOLS, max_calls=2)
    uses = policy.every_use()
    asked = [{"role": "user", "content": words}]
    called = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}
    result = {"role": "tool", "tool_call_id": "c", "content": "{}"}
    for messages in (asked, [*asked, called, result], [*asked, called, result, called, result]):
        assert policy.for_messages(messages) in uses, messages


async def test_a_turn_that_triggers_two_tools_compiles_no_grammar(make_serving, tokenizer):
    serving, context = make_serving(), LLMContext()
    policy = ToolPolicy(TOOLS)
    EngineChat(serving, tokenizer).prepare_tools(policy.every_use())
    compiled = serving.engine.compiled_grammars()
    assert compiled == len(policy.every_use())
    assert policy.first("A slow order, please").required == ("record_order", "slow_check")

    await _run(serving, tokenizer, context,
               [_user(context, "A slow order, please: 48213."), SleepFrame(sleep=3)])
    assert serving.engine.compiled_grammars() == compiled


async def test_a_turn_with_a_tool_call_runs_no_torch_on_the_event_loop(make_serving, tokenizer):
    from tests.loop_guard import torch_calls_on_this_thread

    serving, context = make_serving(), LLMContext()  # nothing compiled ahead: the worker does
    with torch_calls_on_this_thread() as hits:
        await _run(serving, tokenizer, context,
                   [_user(context, "Where is my order 48213?"), SleepFrame(sleep=3)])
    assert [name for name, _ in RUNS] == ["record_order"]
    assert hits == []
