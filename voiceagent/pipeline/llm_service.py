"""ChatLLMService: pipecat's LLM service contract on top of our engine (or a remote one).

The service turns pipecat's universal `LLMContext` into chat messages, submits them to its
`ChatBackend` (chat_backend.py: the shared in-process `llm_engine.serving.EngineWorker`, or a
remote OpenAI-compatible server, remote_llm.py), and streams the text deltas out as pipecat expects
(`LLMFullResponseStartFrame`, `LLMTextFrame`s, `LLMFullResponseEndFrame`; compare
pipecat/services/openai/base_llm.py `process_frame`). Each request's
`RequestStats` leave as an `EngineStatsMetricsData` in a `MetricsFrame`: metrics are data, not
log lines.

Barge-in. pipecat answers an `InterruptionFrame` by cancelling the processor's process task
(frame_processor.py `_start_interruption`), so `CancelledError` lands at whatever
`await` a service is on. The engine loop runs on its own thread and would keep decoding, so the
service cancels the request itself (`RequestHandle.cancel()`: the worker stops at its next step
boundary and frees the KV) and cancels the task that streams its text. Generation runs in a task of
its own, not in the process task, so that a new context can supersede a reply in flight and an
`EndFrame` can wait for it.

What the context keeps of an interrupted reply (pipecat 1.14, read from the source):

- `LLMAssistantAggregator` appends every `TextFrame` with `append_to_context=True` that reaches it
  (llm_response_universal.py `_handle_text`). On an `InterruptionFrame` it commits
  what it holds so far as the assistant message (`_handle_interruptions` ->
  `_trigger_assistant_turn_stopped` -> `push_aggregation` ->
  `_add_aggregation_to_context`). It does no word or timestamp tracking of its own: it
  keeps whatever text frames reached it.
- What reaches it depends on where it sits. In pipecat's standard order
  `[..., llm, tts, transport.output(), assistant]` the TTS consumes our `LLMTextFrame`s
  (tts_service.py `_handle_text`, not forwarded), forwards the aggregated sentence with
  `append_to_context=False` (`_announce_text`), and queues a `TTSTextFrame` with
  `append_to_context=True` behind that sentence's audio (`_push_spoken_text`;
  services with word timestamps push one per word with a pts instead). The output transport
  releases those frames only after the audio queued before them has been written
  (base_output.py `_audio_task_handler`, and the clock task for pts frames), and
  an interruption drops the unplayed rest (`handle_interruptions`: `_audio_queue.reset()`,
  `_clock_queue.reset()`).
- So with a pipecat `TTSService` and the assistant aggregator after the output transport, the
  context holds only spoken text: whole sentences for a TTS without word timestamps (the
  sentence being spoken at barge-in is dropped whole), words for one with them. With no TTS in
  between, the aggregator would keep every `LLMTextFrame` it received.

Tools (voiceagent.tools; wired by tool_calls.py). With tools, each request shows the model the
call's tool list, and a caller's turn whose words match a tool's triggers requires a call of one
of those tools. A reply that ends in a tool call goes to pipecat's function-calling flow
(`LLMService.run_function_calls`): the handler runs, the assistant aggregator writes the call and
its result into the context as tool messages and pushes the context back, and the next request
speaks from the result. Side effects only after commit: the call of a prepared reply waits for
its turn to be confirmed and is dropped with it when withdrawn; a reply cut short (barge-in, a new
context) never reaches its call. After a tool that ends the call, the next finished reply is
followed by an `EndWorkerFrame`, which ends the pipeline once that goodbye has been played.

This service's part: it never pushes text after it has forwarded the `InterruptionFrame`; the
streaming task is cancelled and awaited first. It does not push an `LLMFullResponseEndFrame` for an
interrupted reply either (pipecat's OpenAI service does, from a `finally`, base_llm.py):
that End would be queued ahead of the interruption, so a TTS could flush the unfinished clause into
synthesis, and an aggregator right after the LLM could close the turn as not interrupted, before
the interruption drops it. The `InterruptionFrame` is what ends an interrupted reply downstream,
as it already must for every pipecat processor whose queued End an interruption flushes. A reply
superseded by a new context (no interruption) is closed with an End.

Frames:

    in   StartFrame                     prefill the system prompt into the call's session cache
         LLMContextFrame                end any reply in flight; submit; stream the new reply
         InterruptionFrame              cancel the engine request, stop streaming; forwarded
         LLMContextFrame(speculation)   a reply prepared before the turn is confirmed: the same,
                                        but it starts with a PreparedResponseStartFrame, which
                                        the held-reply gate after the TTS holds until commit
         UserStartedSpeakingFrame       the conversation as it stands prefilled into the call's KV
                                        when nothing else runs and the bot is silent (while it
                                        speaks, the context lacks its reply); forwarded
         UserStoppedSpeakingFrame       the turn is confirmed: the prepared reply is committed; fwd
         UserWordsSoFarFrame            the caller's words so far: prefilled into the call's KV
                                        with the conversation when nothing else runs; consumed
         EagerEndOfTurnCancelFrame      cancel a prepared reply (it is discarded); forwarded
         EndFrame                       let the reply in flight finish, then forwarded
         FunctionCallResultFrame etc.   pipecat's function-call frames, broadcast by the base
                                        class when a reply calls a tool
         CancelFrame                    cancel everything; forwarded
         anything else                  forwarded
    out  LLMFullResponseStartFrame (PreparedResponseStartFrame for a prepared reply), LLMTextFrame
             (one per non-empty delta), LLMFullResponseEndFrame
             (not for an interrupted reply: the InterruptionFrame ends it)
         MetricsFrame[RequestStartedMetricsData] when each engine request starts (its id, and
             whether it is prepared: the clocks observer gives its stats to that turn)
         MetricsFrame[EngineStatsMetricsData] when each engine request ends, interrupted or not,
             whether or not pipecat metrics are enabled (the clocks observer reads it)
         MetricsFrame[TTFB, processing] when pipecat metrics are enabled
         ErrorFrame (upstream, non-fatal) for a refused prompt or a failed engine request
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from loguru import logger
from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    CancelFrame,
    EagerEndOfTurnCancelFrame,
    EndFrame,
    EndWorkerFrame,
    Frame,
    InterruptionFrame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMUpdateSettingsFrame,
    MetricsFrame,
    StartFrame,
    TTSSpeakFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.processors.aggregators.llm_context import (
    LLMContext,
    LLMSpecificMessage,
    standard_message_text,
)
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.llm_service import FunctionCallFromLLM, LLMService
from pipecat.services.settings import LLMSettings
from pipecat.utils.errors import ErrorCategory

from llm_engine.config import SamplingConfig
from llm_engine.serving import Completion
from voiceagent.pipeline.chat_backend import ChatBackend, ChatHandle
from voiceagent.pipeline.continuation import Continuations, continues_last, joined
from voiceagent.pipeline.frames import PreparedResponseStartFrame, UserWordsSoFarFrame
from voiceagent.pipeline.metrics import (
    EngineStatsMetricsData,
    RequestStartedMetricsData,
    TurnContinuesMetricsData,
)
from voiceagent.pipeline.tool_calls import ToolPolicy

_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_CLEANUP_WAIT_S = 2.0  # how long teardown waits for the engine to let go of a cancelled request


def chat_messages(context: LLMContext, system_prompt: str | None = None,
                  examples: Sequence[dict[str, Any]] = (),
                  joins: Collection[int] = frozenset()) -> list[dict[str, Any]]:
    """The context as OpenAI chat messages for the backend (`llm_engine.prompts` renders them
    for the target's chat template).

    Content parts are flattened to their text; an assistant's tool calls and the tool results
    are kept; provider-specific messages and messages without text are left out.
    `system_prompt` goes first when the context has no system message of its own; `examples`
    (an example exchange, `AgentConfig.example_messages`) right after the system message.
    `joins`: user messages the caller went on with (continuation.py).
    """
    messages: list[dict[str, Any]] = []
    for message in joined(context.get_messages(), joins):
        if isinstance(message, LLMSpecificMessage):
            continue
        role = message.get("role", "")
        text = standard_message_text(message)
        if role == "assistant" and message.get("tool_calls"):
            messages.append({"role": "assistant", "content": text or None,
                             "tool_calls": message["tool_calls"]})
        elif role == "tool":
            messages.append({"role": "tool", "content": text,
                             "tool_call_id": message.get("tool_call_id", "")})
        elif role in _CHAT_ROLES and text:
            messages.append({"role": _CHAT_ROLES[role], "content": text})
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    at = 1 if messages and messages[0]["role"] == "system" else 0
    messages[at:at] = [dict(m) for m in examples]
    return messages


def _ends_with_user(context: LLMContext) -> bool:
    messages = [m for m in context.get_messages() if not isinstance(m, LLMSpecificMessage)]
    return bool(messages) and messages[-1].get("role") == "user"


@dataclass(eq=False)
class _Request:
    id: str
    handle: ChatHandle
    prepared: bool  # started before the caller's turn was confirmed
    stream: asyncio.Task | None = None  # pushes the reply's frames; set at submit
    interrupted: bool = False  # the engine request was cut short
    discarded: bool = False  # withdrawn before its turn was confirmed
    push_end: bool = True  # False when an interruption, not an End, ends the reply downstream
    calls: list[FunctionCallFromLLM] = field(default_factory=list)  # not run yet
    early: dict[str, asyncio.Task] = field(default_factory=dict)  # read-only calls run already


class ChatLLMService(LLMService):
    """A pipecat LLM service backed by the speculative engine or a remote server (frames: module
    doc).

    One instance per call. The backend is shared by every call and owned by the server;
    `session_id` names this call's KV prefix cache in it, reused from turn to turn and dropped
    at cleanup.
    """

    def __init__(
        self,
        chat: ChatBackend,
        *,
        session_id: str,
        system_prompt: str | None = None,
        sampling: SamplingConfig | None = None,
        method: str | None = None,
        context: LLMContext | None = None,
        tools: ToolPolicy | None = None,
        examples: Sequence[dict[str, Any]] = (),
        error_reply: str = "",
        continue_within_s: float = 0.0,
        **kwargs,
    ):
        """`sampling` and `method` override the engine config's; None keeps them. `context`: the
        call's conversation, for prefilling the caller's words while they speak (None: off).
        `tools`: what each request may call (their handlers are registered by tool_calls.py).
        `examples`: an example exchange after the system prompt.
        `error_reply`: what the caller hears when a turn's request fails ("": nothing).
        `continue_within_s`: speech this soon after a reply began goes on with the caller's
        sentence (continuation.py); 0: off."""
        # Store-mode settings: every field set. Sampling lives in `SamplingConfig`, so pipecat's
        # sampling fields are None (unsupported). `system_instruction` is pipecat's: the base
        # class composes it with its add-ons and lets an LLMUpdateSettingsFrame change it.
        settings = LLMSettings(
            model=chat.model,
            system_instruction=system_prompt,
            temperature=None,
            max_tokens=None,
            top_p=None,
            top_k=None,
            frequency_penalty=None,
            presence_penalty=None,
            seed=None,
            filter_incomplete_user_turns=False,
            user_turn_completion_config=None,
            use_provider_thinking_default=False,
        )
        super().__init__(settings=settings, **kwargs)
        self._chat = chat
        self._session_id = session_id
        self._sampling = sampling
        self._method = method
        self._numbers = itertools.count(1)
        self._current: _Request | None = None  # the request whose text is streaming
        self._prepared: _Request | None = None  # prepared, its turn not confirmed yet
        self._requests: dict[str, _Request] = {}  # every request not yet reported
        self._reporters: set[asyncio.Task] = set()
        self._context = context
        self._continuations = Continuations(continue_within_s)
        self._call_context: LLMContext | None = None  # the latest context of a committed turn
        # The latest prefill-only request (the system prompt, or the caller's words so far): the
        # next reply's prefix.
        self._prefill: asyncio.Task | None = None
        # Between the bot's first audio and its silence: the context lacks the reply then.
        self._bot_speaking = False
        self._tools = tools or ToolPolicy(())
        self._examples = list(examples)
        self._error_reply = error_reply
        self._ending = False  # a tool ended the call: the next finished reply is the last
        # Tools that may run before the turn is confirmed (read-only ones), by name: each takes
        # a call's arguments and returns its result (tool_calls.py registers them).
        self._early_runners: dict[str, Callable[[dict], Awaitable[Any]]] = {}
        self._early: dict[str, asyncio.Task] = {}  # by tool_call_id, until its handler takes it

    def register_early(self, name: str, run: Callable[[dict], Awaitable[Any]]) -> None:
        """Let tool `name` run on a prepared reply, before its turn is confirmed: it must change
        nothing, since the reply may yet be withdrawn."""
        self._early_runners[name] = run

    def take_early(self, tool_call_id: str) -> asyncio.Task | None:
        """The run a prepared reply started for this call, if any; the handler awaits it."""
        return self._early.pop(tool_call_id, None)

    async def say_reply(self, text: str, prepared: bool = False) -> None:
        """Speak `text` as the reply, as if the model had written it (a tool's template, the
        error reply); a `prepared` one is held until its turn is confirmed."""
        await self.push_frame(
            PreparedResponseStartFrame() if prepared else LLMFullResponseStartFrame())
        await self._push_llm_text(text)
        await self.push_frame(LLMFullResponseEndFrame())

    def end_after_reply(self) -> None:
        """Hang up once the next reply has been spoken (a tool like `end_call` ran)."""
        self._ending = True

    async def hang_up(self, goodbye: str) -> None:
        """Say `goodbye`, then end the pipeline once it has been played."""
        await self.push_frame(TTSSpeakFrame(goodbye))
        await self.push_frame(EndWorkerFrame(reason="a tool ended the call"))

    # -- frames ---------------------------------------------------------------------------------

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        prepared = False
        if isinstance(frame, LLMContextFrame):
            # Before the base class registers the new inference: the superseded reply's End
            # belongs to the old one.
            await self._interrupt(push_end=True)
            # A prepared reply is held after the TTS (held_reply.py), so that its first phrase is
            # synthesised before the turn is confirmed; the base class's own gate, which would
            # hold it here, must let it through.
            prepared, frame = frame.speculation, dataclasses.replace(frame, speculation=False)
        await super().process_frame(frame, direction)

        if isinstance(frame, LLMContextFrame):
            await self._begin(frame.context, prepared=prepared)
        elif isinstance(frame, InterruptionFrame):
            if (call := self._context or self._call_context) is not None:
                self._continuations.interrupted(call.get_messages())
            await self._interrupt(push_end=False)
            await self.push_frame(frame, direction)
        elif isinstance(frame, EagerEndOfTurnCancelFrame):
            # The prepared reply may have finished generating already; it is withdrawn all the
            # same (its tokens count as wasted), and stopped if it is still going.
            request, self._prepared = self._prepared, None
            if request is not None:
                request.discarded = True
                await self._drop_early(request)
                if request is self._current:
                    await self._interrupt(push_end=False)
            await self.push_frame(frame, direction)
        elif isinstance(frame, UserStoppedSpeakingFrame):
            # The turn is confirmed: its prepared reply is committed, and its tool call may run.
            request, self._prepared = self._prepared, None
            if request is not None:
                self._continuations.committed()
            await self.push_frame(frame, direction)
            if request is not None and request.calls:
                await self._run_calls(request)
        elif isinstance(frame, UserWordsSoFarFrame):
            self._prefill_words(frame.text)
        elif isinstance(frame, LLMUpdateSettingsFrame):
            pass  # LLMService applied it, or pushed it on when it names another service
        else:
            if isinstance(frame, BotStartedSpeakingFrame):
                self._bot_speaking = True
                self._continuations.heard()
            elif isinstance(frame, BotStoppedSpeakingFrame):
                self._bot_speaking = False
                self._continuations.finished()
            elif isinstance(frame, UserStartedSpeakingFrame) and not self._bot_speaking:
                self._prefill_words()
            await self.push_frame(frame, direction)

    async def start(self, frame: StartFrame):
        await super().start(frame)
        self._warm_up()

    def _warm_up(self) -> None:
        """Prefill the system prompt (and the examples) into this call's session cache before the
        caller's first turn, so turn 1 only prefills the caller's words (the engine reuses the
        shared prefix)."""
        messages = self._messages(LLMContext())
        if messages:
            self._submit_prefill(messages)

    def _prefill_words(self, text: str = "") -> None:
        """Prefill the conversation and the caller's words so far while they speak, so the reply
        (prepared at the pause, or not) prefills only the words after them. With no words yet
        (the caller's turn starts), the conversation alone: what the call's KV lacks of it since
        the last reply, a tool's call and result, a spoken template, would otherwise be prefilled
        after the turn end when the caller's words come too soon to be prefilled (110 tokens,
        400 ms on one core after a tool turn). Only when the engine has nothing else of this
        call: a reply in flight owns the call's KV."""
        if self._context is None or self._requests:
            return
        if self._prefill is not None and not self._prefill.done():
            return
        said = [{"role": "user", "content": text}] if text else []
        self._submit_prefill(self._messages(LLMContext([*self._context.get_messages(), *said])))

    def _submit_prefill(self, messages: list[dict[str, Any]]) -> None:
        """A one-token request that leaves `messages` in this call's KV cache."""
        one = SamplingConfig(max_new_tokens=1)
        try:
            handle = self._chat.submit(messages, one, self._session_id, self._method,
                                       self._tools.for_messages(messages), prefill=True)
        except ValueError as exc:  # over max_context: the real turn reports it
            logger.warning(f"{self}: prefill refused: {exc}")
            return
        self._prefill = self.create_task(handle.result(), f"prefill-{self._session_id}")

    def _messages(self, context: LLMContext) -> list[dict[str, Any]]:
        system = self._settings.system_instruction
        return chat_messages(context, system if isinstance(system, str) else None, self._examples,
                             self._continuations.joins)

    async def stop(self, frame: EndFrame):
        # An EndFrame is the graceful end: AIService.stop "runs in frame order, after pending
        # frames drain" and is where in-flight work is flushed (ai_service.py), as
        # pipecat's own LLM services finish their completion before the EndFrame passes. The
        # reply in flight (bounded by max_new_tokens) finishes and every request's stats are
        # pushed before the EndFrame moves on; nothing outlives the pipeline.
        if self._reporters:
            await asyncio.wait(set(self._reporters))
        await super().stop(frame)

    async def cancel(self, frame: CancelFrame):
        await self._abort()
        await super().cancel(frame)

    async def cleanup(self):
        handles = [request.handle for request in self._requests.values()]
        if self._prefill is not None and not self._prefill.done():
            # Not waited for: a call refused at once must give its slot back at once. The engine
            # frees its KV on release, since the session is dropped below.
            await self.cancel_task(self._prefill)
        await self._abort()
        # The engine frees a cancelled request's KV at its next step boundary, and a request's
        # release stores the session cache; drop the session once they are all over.
        for handle in handles:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(handle.result(), _CLEANUP_WAIT_S)
        self._chat.drop_session(self._session_id)
        await super().cleanup()

    # -- one request ----------------------------------------------------------------------------

    async def _begin(self, context: LLMContext, prepared: bool) -> None:
        # No wait for a prefill in flight: a request takes its session's KV at its first step,
        # and the engine's worker holds it back for the round in which the call's one-token
        # prefill ends (`llm_engine.serving`). Nothing here awaits before the request is
        # registered, so a withdrawal or an interruption that arrives next always finds it.
        self._log_llm_response(context)
        if not prepared:
            self._call_context = context  # the call's own: pipecat writes every turn into it
            if _ends_with_user(context):  # the caller's turn, not a tool result's answer
                self._continuations.committed()
        try:
            messages = self._messages(context)
            handle = self._chat.submit(messages, self._sampling, self._session_id, self._method,
                                       self._tools.for_messages(messages))
        except Exception as exc:  # a refused prompt must not take the call down
            # ValueError is the prompt itself (too long for max_context, empty): the context is
            # at fault, not the service, so pipecat must not mark the service unusable.
            category = (
                ErrorCategory.APPLICATION if isinstance(exc, ValueError) else ErrorCategory.UNKNOWN
            )
            await self.push_error(f"LLM request refused: {exc}", exception=exc, category=category)
            if self._error_reply:  # the request never started: say it as a reply of its own
                await self.say_reply(self._error_reply, prepared)
            return
        # No await from submit to here: an interruption cancels the process task at an await,
        # and must find the request registered, with its tasks.
        request = _Request(f"{self._session_id}-{next(self._numbers)}", handle, prepared)
        request.stream = self.create_task(self._stream(request, context), f"stream-{request.id}")
        reporter = self.create_task(self._report(request), f"report-{request.id}")
        self._reporters.add(reporter)
        reporter.add_done_callback(self._reporters.discard)
        self._requests[request.id] = request
        self._current = request
        superseded, self._prepared = self._prepared, request if prepared else None
        await self.push_frame(MetricsFrame(data=[RequestStartedMetricsData(
            processor=self.name, request_id=request.id, prepared=prepared)]))
        if superseded is not None:  # its turn was never confirmed: its early results go
            await self._drop_early(superseded)
        if continues_last(context.get_messages(), self._continuations.joins):
            # The turn's record says what the model was asked: this turn and the one before.
            await self.push_frame(MetricsFrame(data=[TurnContinuesMetricsData(
                processor=self.name)]))

    async def _stream(self, request: _Request, context: LLMContext) -> None:
        """Push the reply's frames as the engine's deltas arrive; then its tool call, or the end
        of the call."""
        await self.start_processing_metrics()
        await self.start_ttfb_metrics()
        await self.push_frame(
            PreparedResponseStartFrame() if request.prepared else LLMFullResponseStartFrame())
        try:
            async for delta in request.handle:
                if delta.text:
                    await self.stop_ttfb_metrics()
                    await self._push_llm_text(delta.text)
            if (await request.handle.result()).finish_reason == "error" and self._error_reply:
                # Never silent: the caller learns to say it again (the turn keeps its error).
                await self._push_llm_text(self._error_reply)
        finally:
            if self._current is request:
                self._current = None
            await self.stop_processing_metrics()
            if request.push_end:
                await self.push_frame(LLMFullResponseEndFrame())
        completion = await request.handle.result()
        if completion.tool_calls:
            request.calls = [self._call(call, context) for call in completion.tool_calls]
            if self._prepared is not request:
                await self._run_calls(request)
            else:  # it waits for the turn to be confirmed; read-only tools may run meanwhile
                self._run_early(request)
        elif self._ending and completion.finish_reason != "error":
            # The goodbye is queued ahead of this frame: the pipeline ends once it is played.
            await self.push_frame(EndWorkerFrame(reason="a tool ended the call"))

    @staticmethod
    def _call(call: dict, context: LLMContext) -> FunctionCallFromLLM:
        arguments = call.get("arguments")
        return FunctionCallFromLLM(
            function_name=str(call.get("name", "")),
            tool_call_id=call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
            arguments=arguments if isinstance(arguments, dict) else {},
            context=context,
        )

    async def _run_calls(self, request: _Request) -> None:
        calls, request.calls = request.calls, []
        if not request.discarded and not request.interrupted:
            self._continuations.ran_tools()
            await self.run_function_calls(calls)

    def _run_early(self, request: _Request) -> None:
        for call in request.calls:
            run = self._early_runners.get(call.function_name)
            if run is not None:
                task = self.create_task(run(dict(call.arguments)), f"early-{call.tool_call_id}")
                request.early[call.tool_call_id] = self._early[call.tool_call_id] = task

    async def _drop_early(self, request: _Request) -> None:
        """A withdrawn reply's read-only results go with it."""
        for call_id, task in request.early.items():
            self._early.pop(call_id, None)
            await self.cancel_task(task)
        request.early.clear()

    async def _report(self, request: _Request) -> None:
        """Once the engine has ended the request, push its stats (and its error, if any)."""
        if request.stream is not None:
            await asyncio.wait({request.stream})  # one reader of the handle at a time
        completion = await request.handle.result()  # drains what an interrupted stream left
        self._requests.pop(request.id, None)
        if completion.error:
            await self.push_error(
                f"LLM engine request {request.id} failed: {completion.error}",
                category=ErrorCategory.UNKNOWN,
            )
        await self.push_frame(MetricsFrame(data=[self._metrics_data(request, completion)]))

    def _metrics_data(self, request: _Request, completion: Completion) -> EngineStatsMetricsData:
        model = self._settings.model
        return EngineStatsMetricsData(
            processor=self.name,
            model=model if isinstance(model, str) else None,
            request_id=request.id,
            interrupted=request.interrupted,
            finish_reason=completion.finish_reason,
            stats=completion.stats,
            prepared=request.prepared,
            discarded=request.discarded,
            error=completion.error,
        )

    async def _interrupt(self, push_end: bool) -> None:
        """Stop the reply in flight: the engine at its next step, the text now."""
        request = self._current
        if request is None:
            return
        self._current = None
        request.interrupted = True
        request.push_end = push_end
        # Explicitly: the engine's loop runs on a thread, which cancelling a coroutine won't stop.
        request.handle.cancel()
        if request.stream is not None:
            await self.cancel_task(request.stream)
        logger.debug(f"{self}: request {request.id} cancelled")

    async def _abort(self) -> None:
        """Cancel every request and task without waiting for stats (the pipeline is going)."""
        await self._interrupt(push_end=False)
        for request in self._requests.values():
            request.handle.cancel()
        for task in self._early.values():
            await self.cancel_task(task)
        self._early.clear()
        for reporter in list(self._reporters):
            await self.cancel_task(reporter)
