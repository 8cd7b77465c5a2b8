"""ChatLLMService in pipecat's run_test harness, on a tiny random-weight engine."""

from __future__ import annotations

import asyncio

import pytest
from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    CancelFrame,
    EagerEndOfTurnCancelFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    MetricsFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.aggregators.llm_context import LLMContext, LLMSpecificMessage
from pipecat.processors.aggregators.llm_response_universal import LLMAssistantAggregator
from pipecat.tests.utils import SleepFrame, run_test

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.prompts import encode_chat
from tests.voiceagent.scripted_engine import RecordingAsyncEngine, ScriptedEngine
from voiceagent.pipeline.chat_backend import EngineChat
from voiceagent.pipeline.frames import PreparedResponseStartFrame, UserWordsSoFarFrame
from voiceagent.pipeline.llm_service import ChatLLMService, chat_messages
from voiceagent.pipeline.metrics import EngineStatsMetricsData, TurnContinuesMetricsData

SESSION = "call-1"
# Long enough that a held request can't run out of tokens before it is held (at most 1 + 3 * 9
# with K <= 8), short enough that the requests which run to the end keep the tests quick.
MAX_NEW = 64
BEFORE_INTERRUPTION_S = 1.0  # prefill and a few steps, with room for a loaded 2-core CPU


@pytest.fixture
def make_serving(model, tokenizer):
    engines = []

    def make(max_context: int = 1024, **scripted) -> RecordingAsyncEngine:
        config = EngineConfig(
            max_context=max_context,
            speculation=SpeculationConfig(method="ngram", gate=False),
            sampling=SamplingConfig(max_new_tokens=MAX_NEW),
        )
        # No EOS: a held reply must not end on its own before the interruption.
        engine = ScriptedEngine(model, tokenizer, config, eos_token_ids=set(), **scripted)
        serving = RecordingAsyncEngine(engine)
        engines.append(serving)
        return serving

    yield make
    for serving in engines:
        serving.close()


def _service(serving, tokenizer, **kwargs) -> ChatLLMService:
    return ChatLLMService(EngineChat(serving, tokenizer), session_id=SESSION, **kwargs)


def _context(text: str) -> LLMContextFrame:
    return LLMContextFrame(context=LLMContext(messages=[{"role": "user", "content": text}]))


def _engine_stats(frames) -> list[EngineStatsMetricsData]:
    return [
        data
        for frame in frames
        if isinstance(frame, MetricsFrame)
        for data in frame.data
        if isinstance(data, EngineStatsMetricsData)
    ]


def _replies(frames) -> list[str]:
    """The text of each reply, Start to End or interruption; asserts that they are well formed."""
    replies, current = [], None
    for frame in frames:
        if isinstance(frame, InterruptionFrame) and current is not None:
            replies.append("".join(current))
            current = None
        elif isinstance(frame, LLMFullResponseStartFrame):
            assert current is None, "a reply started inside another"
            current = []
        elif isinstance(frame, LLMTextFrame):
            assert current is not None, "text outside a reply"
            current.append(frame.text)
        elif isinstance(frame, LLMFullResponseEndFrame):
            assert current is not None
            replies.append("".join(current))
            current = None
    assert current is None, "a reply was never ended"
    return replies


async def test_context_streams_start_text_end_and_the_engine_text(make_serving, tokenizer):
    serving = make_serving()
    llm = _service(serving, tokenizer, system_prompt="Be brief.")

    down, up = await run_test(llm, frames_to_send=[_context("Hello, how can I help you today?")])

    _warmup, handle = serving.handles
    completion = await handle.result()
    assert completion.finish_reason == "length"
    assert _replies(down) == [completion.text]
    assert sum(isinstance(f, LLMTextFrame) for f in down) >= 1
    assert all(f.text for f in down if isinstance(f, LLMTextFrame))
    (stats,) = _engine_stats(down)
    assert not stats.interrupted and stats.finish_reason == "length"
    assert stats.stats.generated_tokens == len(completion.token_ids)
    assert stats.model == serving.engine.config.target
    expected = encode_chat(
        tokenizer,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello, how can I help you today?"},
        ],
    )
    assert handle.state.prompt_ids == expected
    assert handle.state.session_id == SESSION
    assert not any(isinstance(f, ErrorFrame) for f in up)
    assert serving.engine.dropped_sessions == [SESSION]  # the call's KV goes with its pipeline


async def test_words_so_far_are_prefilled_so_the_reply_prefills_only_the_rest(
        make_serving, tokenizer):
    serving = make_serving()
    context = LLMContext(messages=[{"role": "assistant", "content": "Hello, this is the bot."}])
    llm = _service(serving, tokenizer, context=context)
    question = "What is the capital of Spain and why?"
    reply_context = LLMContext(messages=[*context.get_messages(),
                                         {"role": "user", "content": question}])
    frames = [UserWordsSoFarFrame("What is the capital"), SleepFrame(sleep=0.5),
              LLMContextFrame(context=reply_context)]
    await asyncio.wait_for(run_test(llm, frames_to_send=frames), 60)
    words, reply = serving.handles
    words_prompt = encode_chat(tokenizer, [*context.get_messages(),
                                           {"role": "user", "content": "What is the capital"}])
    assert words.state.prompt_ids == words_prompt and words.state.sampling.max_new_tokens == 1
    stats = (await reply.result()).stats
    # Everything up to the words so far came from the session's KV, not a new prefill.
    shared = next(i for i, (a, b) in enumerate(zip(words_prompt, reply.state.prompt_ids,
                                                    strict=False)) if a != b)
    assert stats.reused_prefix_tokens == shared
    assert stats.prefill_tokens == len(reply.state.prompt_ids) - shared


async def test_the_conversation_is_prefilled_when_the_callers_turn_starts(make_serving,
                                                                          tokenizer):
    # A tool's call and result, which the call's KV never held: prefilled while the caller speaks.
    serving = make_serving()
    context = LLMContext(messages=[
        {"role": "user", "content": "Where is order 48213?"},
        {"role": "assistant", "content": "Order 4 8 2 1 3 is shipped."}])
    llm = _service(serving, tokenizer, context=context)
    reply_context = LLMContext(messages=[*context.get_messages(),
                                         {"role": "user", "content": "Thanks, bye."}])
    frames = [UserStartedSpeakingFrame(), SleepFrame(sleep=0.5),
              LLMContextFrame(context=reply_context)]
    await asyncio.wait_for(run_test(llm, frames_to_send=frames), 60)
    history, reply = serving.handles
    assert history.state.prompt_ids == encode_chat(tokenizer, context.get_messages())
    assert history.state.sampling.max_new_tokens == 1
    stats = (await reply.result()).stats
    # Everything up to the caller's new message came from the session's KV.
    pairs = zip(history.state.prompt_ids, reply.state.prompt_ids, strict=False)
    shared = next(i for i, (a, b) in enumerate(pairs) if a != b)
    assert stats.reused_prefix_tokens == shared
    assert stats.prefill_tokens == len(reply.state.prompt_ids) - shared


async def test_no_conversation_prefill_while_the_bot_speaks(make_serving, tokenizer):
    # The context lacks the reply being spoken: a prefill of it would crop the reply's KV.
    serving = make_serving()
    context = LLMContext(messages=[{"role": "user", "content": "Hello"}])
    frames = [BotStartedSpeakingFrame(), UserStartedSpeakingFrame(), SleepFrame(sleep=0.3)]
    await asyncio.wait_for(run_test(_service(serving, tokenizer, context=context),
                                    frames_to_send=frames), 60)
    assert serving.handles == []


async def test_start_prefills_the_system_prompt_into_the_session(make_serving, tokenizer):
    serving = make_serving()
    llm = _service(serving, tokenizer, system_prompt="Be brief.")
    await run_test(llm, frames_to_send=[_context("Hello")])
    warmup, request = serving.handles
    system_only = encode_chat(tokenizer, [{"role": "system", "content": "Be brief."}])
    assert warmup.state.prompt_ids == system_only
    assert warmup.state.sampling.max_new_tokens == 1
    assert warmup.state.session_id == request.state.session_id == SESSION
    # The request reused the warmed-up prefix instead of prefilling the system prompt again.
    assert request.state.stats.reused_prefix_tokens > 0


async def _cut_mid_reply(make_serving, tokenizer, first: Frame, *then: Frame):
    """`first` starts a reply the engine holds mid-way; `then` arrive while it is in flight.
    Returns the frames sent down and the engine requests made."""
    serving = make_serving(hold_first=True)
    frames = [first, SleepFrame(sleep=BEFORE_INTERRUPTION_S), *then]
    down, _ = await asyncio.wait_for(
        run_test(_service(serving, tokenizer), frames_to_send=frames), 60)
    return down, serving.handles


async def test_interruption_cancels_the_engine_request_and_text_stops(make_serving, tokenizer):
    down, (interrupted, follow) = await _cut_mid_reply(
        make_serving, tokenizer, _context("Hello, how can I help you today?"),
        InterruptionFrame(), SleepFrame(sleep=0.2), _context("Thank you for calling."))
    cut = await interrupted.result()
    assert cut.finish_reason == "cancelled"
    assert len(cut.token_ids) < MAX_NEW
    assert interrupted.state.released and interrupted.state.cache is None  # KV freed
    assert cut.stats.cancel_to_stop_ms is not None

    i = next(n for n, f in enumerate(down) if isinstance(f, InterruptionFrame))
    before, after = down[:i], down[i + 1 :]
    streamed = [f.text for f in before if isinstance(f, LLMTextFrame)]
    assert streamed and cut.text.startswith("".join(streamed))  # it was mid-stream
    assert not any(isinstance(f, LLMFullResponseEndFrame) for f in before)  # no End to flush TTS
    second_start = next(n for n, f in enumerate(after) if isinstance(f, LLMFullResponseStartFrame))
    assert not any(
        isinstance(f, (LLMTextFrame, LLMFullResponseEndFrame)) for f in after[:second_start]
    )

    # The next request after the barge-in streams normally.
    done = await follow.result()
    assert done.finish_reason == "length"
    assert _replies(after) == [done.text]
    stats = {s.request_id: s for s in _engine_stats(down)}
    assert len(stats) == 2
    first, second = (stats[f"{SESSION}-{n}"] for n in (1, 2))
    assert first.interrupted and first.finish_reason == "cancelled"
    assert first.stats.finish_reason == "cancelled"
    assert not second.interrupted and second.finish_reason == "length"


# (window s, what happens between the commit and the caller's speech, what the bot had written
# into the context, whether the caller goes on)
_GOING_ON = {
    "at once": (30.0, [], "", True),
    "soon after a slow first audio": (1.0, [SleepFrame(1.5), BotStartedSpeakingFrame()], "", True),
    "after the reply was heard": (30.0, [BotStartedSpeakingFrame(), BotStoppedSpeakingFrame()],
                                  "", False),
    "after a clause was heard": (30.0, [], "The", False),
    "off": (0.0, [], "", False),
}


@pytest.mark.parametrize("case", _GOING_ON)
async def test_speech_as_the_reply_begins_joins_the_callers_words_in_the_next_prompt(
        make_serving, tokenizer, case):
    within_s, between, written, continues = _GOING_ON[case]
    serving = make_serving(hold_first=True)
    context = LLMContext(messages=[{"role": "user", "content": "What is the capital?"}])
    llm = _service(serving, tokenizer, continue_within_s=within_s)

    def frames():
        yield LLMContextFrame(context=context)
        while not serving.handles:  # the reply is committed once its request is in
            yield SleepFrame(sleep=0.02)
        yield from between
        yield SleepFrame(sleep=0.1)
        yield InterruptionFrame()  # the caller speaks
        yield SleepFrame(sleep=0.2)
        # What pipecat's aggregators write: what was played of the reply, then the caller's words.
        context.add_message({"role": "assistant", "content": written})
        context.add_message({"role": "user", "content": "of Spain?"})
        yield LLMContextFrame(context=context)

    down, _ = await asyncio.wait_for(run_test(llm, frames_to_send=frames()), 60)
    _, second = serving.handles
    if continues:
        said = [{"role": "user", "content": "What is the capital of Spain?"}]
    else:
        said = [m for m in context.get_messages() if m["content"]]
    assert second.state.prompt_ids == encode_chat(tokenizer, said)
    marked = [d for f in down if isinstance(f, MetricsFrame) for d in f.data
              if isinstance(d, TurnContinuesMetricsData)]
    assert len(marked) == int(continues)


async def test_assistant_aggregator_closes_the_reply_as_interrupted(make_serving, tokenizer):
    # No TTS here, so pipecat's aggregator keeps what reached it: the text streamed before the
    # barge-in. (With a TTS and the aggregator after the output transport, that shrinks to what
    # was spoken; see the module docstring of voiceagent.pipeline.llm_service.)
    serving = make_serving(hold_first=True)
    context = LLMContext(messages=[{"role": "user", "content": "Hello"}])
    aggregator = LLMAssistantAggregator(context)
    turns = []

    @aggregator.event_handler("on_assistant_turn_stopped")
    async def on_turn_stopped(_, message):
        turns.append(message)

    frames = [
        LLMContextFrame(context=context),
        SleepFrame(sleep=BEFORE_INTERRUPTION_S),
        InterruptionFrame(),
        SleepFrame(sleep=0.2),
    ]

    pipeline = Pipeline([_service(serving, tokenizer), aggregator])
    await asyncio.wait_for(run_test(pipeline, frames_to_send=frames), 60)

    (handle,) = serving.handles
    cut = await handle.result()
    _, assistant = context.get_messages()
    assert assistant["role"] == "assistant" and assistant["content"]
    assert cut.text.strip().startswith(assistant["content"])
    (turn,) = turns  # one turn, closed by the interruption rather than by an End
    assert turn.interrupted and turn.content == assistant["content"]


async def test_new_context_cancels_the_reply_in_flight(make_serving, tokenizer):
    down, (superseded, follow) = await _cut_mid_reply(
        make_serving, tokenizer, _context("Hello, how can I help you today?"),
        _context("Thank you for calling."))
    assert (await superseded.result()).finish_reason == "cancelled"
    replies = _replies(down)  # two replies, one after the other, never interleaved
    assert replies[1] == (await follow.result()).text
    reasons = {s.request_id: (s.interrupted, s.finish_reason) for s in _engine_stats(down)}
    assert reasons == {f"{SESSION}-1": (True, "cancelled"), f"{SESSION}-2": (False, "length")}


async def test_prompt_too_long_gives_an_error_frame_and_the_pipeline_goes_on(
    make_serving, tokenizer
):
    serving = make_serving(max_context=64)
    llm = _service(serving, tokenizer)
    frames = [_context("Hello, how can I help you today? " * 20), _context("Hello")]

    down, up = await run_test(llm, frames_to_send=frames)

    (error,) = [f for f in up if isinstance(f, ErrorFrame)]
    assert "max_context" in error.error and not error.fatal
    assert llm.is_usable
    (handle,) = serving.handles  # the long prompt never reached the engine
    assert _replies(down) == [(await handle.result()).text]


async def test_failed_engine_request_gives_an_error_frame_and_the_next_one_works(
    make_serving, tokenizer
):
    serving = make_serving(fail_first=True)
    llm = _service(serving, tokenizer)

    frames = [_context("Hello"), SleepFrame(sleep=BEFORE_INTERRUPTION_S), _context("Hello again")]

    down, up = await run_test(llm, frames_to_send=frames)

    (error,) = [f for f in up if isinstance(f, ErrorFrame)]
    assert "scripted failure" in error.error and not error.fatal
    failed, follow = serving.handles
    assert (await failed.result()).finish_reason == "error"
    assert _replies(down)[1] == (await follow.result()).text
    reasons = [s.finish_reason for s in _engine_stats(down)]
    assert reasons == ["error", "length"]


APOLOGY = "Sorry, I missed that. Could you say it again?"


async def test_a_failed_request_speaks_the_error_reply_and_reports_its_error(
    make_serving, tokenizer
):
    serving = make_serving(fail_first=True)
    llm = _service(serving, tokenizer, error_reply=APOLOGY)

    down, _ = await run_test(llm, frames_to_send=[_context("Hello")])

    assert _replies(down) == [APOLOGY]
    (stats,) = _engine_stats(down)
    assert stats.finish_reason == "error" and "scripted failure" in stats.error


async def test_a_refused_prompt_speaks_the_error_reply(make_serving, tokenizer):
    serving = make_serving(max_context=64)
    llm = _service(serving, tokenizer, error_reply=APOLOGY)

    down, _ = await run_test(llm, frames_to_send=[_context("Hello, how can I help? " * 20)])

    assert _replies(down) == [APOLOGY] and not serving.handles


async def test_a_refused_prepared_prompt_holds_its_error_reply_for_the_turn(
    make_serving, tokenizer
):
    serving = make_serving(max_context=64)
    llm = _service(serving, tokenizer, error_reply=APOLOGY)
    prepared = _prepared("Hello, how can I help? " * 20)

    down, _ = await run_test(llm, frames_to_send=[prepared])

    starts = [f for f in down if isinstance(f, LLMFullResponseStartFrame)]
    assert [type(f) for f in starts] == [PreparedResponseStartFrame]
    assert "".join(f.text for f in down if isinstance(f, LLMTextFrame)) == APOLOGY


async def test_cancel_frame_cancels_the_engine_request(make_serving, tokenizer):
    serving = make_serving(hold_first=True)
    llm = _service(serving, tokenizer)
    frames = [_context("Hello"), SleepFrame(sleep=BEFORE_INTERRUPTION_S), CancelFrame()]

    await asyncio.wait_for(run_test(llm, frames_to_send=frames, send_end_frame=False), 60)

    (handle,) = serving.handles
    completion = await asyncio.wait_for(handle.result(), 10)
    assert completion.finish_reason == "cancelled"
    assert handle.state.released
    assert serving.engine.dropped_sessions == [SESSION]


def test_chat_messages_flattens_parts_and_keeps_tool_traffic():
    call = {"id": "1", "type": "function",
            "function": {"name": "lookup_order", "arguments": '{"order_id": "48213"}'}}
    context = LLMContext(
        messages=[
            {"role": "developer", "content": "Speak plainly."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Where is"},
                    {"type": "text", "text": "my order?"},
                ],
            },
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "1", "content": '{"status": "shipped"}'},
            LLMSpecificMessage(llm="other", message={"anything": True}),
            {"role": "assistant", "content": "It has shipped."},
        ]
    )

    assert chat_messages(context, system_prompt="Be brief.") == [
        {"role": "system", "content": "Speak plainly."},
        {"role": "user", "content": "Where is my order?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "1", "content": '{"status": "shipped"}'},
        {"role": "assistant", "content": "It has shipped."},
    ]


def test_chat_messages_prepends_the_system_prompt_only_when_there_is_none():
    context = LLMContext(messages=[{"role": "user", "content": "Hi"}])

    assert chat_messages(context, system_prompt="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert chat_messages(context) == [{"role": "user", "content": "Hi"}]


def _prepared(text: str) -> LLMContextFrame:
    frame = _context(text)
    frame.speculation = True
    return frame


async def test_withdrawn_prepared_reply_is_cancelled_and_reported_as_discarded(
        make_serving, tokenizer):
    down, (withdrawn, answer) = await _cut_mid_reply(
        make_serving, tokenizer, _prepared("What is the capital"), EagerEndOfTurnCancelFrame(),
        SleepFrame(sleep=0.2), _context("What is the capital of Spain?"))
    assert (await withdrawn.result()).finish_reason == "cancelled"
    starts = [f for f in down if isinstance(f, LLMFullResponseStartFrame)]
    assert [type(f) for f in starts] == [PreparedResponseStartFrame, LLMFullResponseStartFrame]
    stats = {s.request_id: s for s in _engine_stats(down)}
    first, second = (stats[f"{SESSION}-{n}"] for n in (1, 2))
    assert first.prepared and first.discarded and first.interrupted
    assert not second.prepared and not second.discarded
    assert (await answer.result()).finish_reason == "length"


async def test_confirmed_prepared_reply_runs_to_its_end(make_serving, tokenizer):
    serving = make_serving()
    llm = _service(serving, tokenizer)
    frames = [
        _prepared("What is the capital of Spain?"),
        UserStoppedSpeakingFrame(),  # the turn ends as prepared
        EagerEndOfTurnCancelFrame(),  # a withdrawal after the commit changes nothing
    ]
    down, _ = await asyncio.wait_for(run_test(llm, frames_to_send=frames), 60)
    [handle] = serving.handles
    done = await handle.result()
    assert done.finish_reason == "length"
    assert _replies(down) == [done.text]
    [stats] = _engine_stats(down)
    assert stats.prepared and not stats.discarded and not stats.interrupted
