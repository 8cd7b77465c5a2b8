"""Assemble one call's pipecat pipeline from the config and the process-wide models.

    transport.input() -> PausingVADProcessor (Silero) -> StreamingWhisperSTTService
      -> DTMFAggregator -> user aggregator -> ChatLLMService -> ClausePiperTTSService
      -> HeldReplyGate -> OnsetHold -> transport.output() -> assistant aggregator

Early preparation (turn.prepare) runs through it: the VAD reports the caller's pause, the STT
transcribes it as an eager end of turn, the user aggregator's stop strategy (turns.py) starts a
reply from a provisional context, and the gate after the TTS holds that reply until the turn is
confirmed. The hold after it keeps a reply from starting over a caller whose voice is rising.

The LLM (the in-process engine, or a client of a remote OpenAI-compatible server: `llm.backend`)
and the speech models (ASR, TTS, VAD, Smart Turn) are loaded once per process (`SharedModels`)
and shared by every call; each call gets its own services, context and clocks observer.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

# pipecat imports this (and the openai SDK, 0.4 s) lazily when the first LLM service is built:
# on the event loop, during the first call. Import it with the rest instead.
import pipecat.adapters.llm.services.open_ai_adapter  # noqa: F401
from loguru import logger
from pipecat.audio.dtmf.types import KeypadEntry
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.dtmf_aggregator import DTMFAggregator
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMContextAggregatorPair,
    LLMUserAggregatorParams,
)
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.transports.base_transport import BaseTransport

from llm_engine.prompts import encode_chat
from llm_engine.serving import EngineWorker
from voiceagent.config import Config, LLMConfig, TurnConfig
from voiceagent.llm_setup import LLMRuntime, build_runtime, threads_beside
from voiceagent.models import resolve
from voiceagent.pipeline.chat_backend import ChatBackend, EngineChat
from voiceagent.pipeline.clocks import ClocksObserver
from voiceagent.pipeline.failover import FailoverChat
from voiceagent.pipeline.held_reply import HeldReplyGate
from voiceagent.pipeline.llm_service import ChatLLMService
from voiceagent.pipeline.onset_hold import HOLD_MARGIN_S, OnsetHold
from voiceagent.pipeline.recording import call_recorder, recordings_dir
from voiceagent.pipeline.remote_llm import RemoteChat, RemoteLLMError, connect
from voiceagent.pipeline.speech_models import (
    SpeechModels,
    decoding_load,
    load_voice,
    recognition_load,
)
from voiceagent.pipeline.stt import make_stt
from voiceagent.pipeline.tool_calls import ToolPolicy, register_tools
from voiceagent.pipeline.tts import make_tts
from voiceagent.pipeline.turn_record import TurnRecord
from voiceagent.pipeline.turns import turn_strategies
from voiceagent.pipeline.utterance_end import UtteranceEnd
from voiceagent.pipeline.vad import PausingVADProcessor, make_vad
from voiceagent.tools import load_tools, takes_whole_number
from voiceagent.urls import redact


@dataclass
class SharedModels:
    """Loaded once per process and shared by every call. With a remote LLM (`llm.backend:
    openai`) there is no in-process engine: `llm` and `worker` are None. `speech` is None in a
    process that serves no calls (tests of the HTTP API)."""

    llm: LLMRuntime | None
    worker: EngineWorker | None
    chat: ChatBackend | None = None  # the pipeline's LLM; None: the in-process engine
    speech: SpeechModels | None = None

    def __post_init__(self) -> None:
        if self.chat is None:
            if self.worker is None or self.llm is None:
                raise ValueError("SharedModels needs an engine worker or a chat backend")
            self.chat = EngineChat(self.worker, self.llm.target.tokenizer)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.speech is not None:
            self.speech.close()


def load_shared(cfg: Config, progress: Callable[[str], None] = print,
                also: Collection[str] = ()) -> SharedModels:
    """Load the TTS voice, then the LLM (with the drafts of the methods in `also`, for a
    benchmark) on its engine thread, so the first call pays for no load, then the other speech
    models; the engine measures its threads beside the speech synthesis (`engine.threads:
    auto`), Whisper runs on the cores it leaves (`asr.cpu_threads: auto`), and the engine then
    measures the threads it steps on while Whisper or Piper runs. A remote LLM is
    checked (it answers, it serves the model) instead of loaded. The configured tools are
    imported first: a bad entry fails here, before any model loads."""
    tools = load_tools(cfg.agent.tools)
    fallback = cfg.llm.fallback
    resolve(cfg.asr.model, "asr")  # a bad name fails before the engine loads and measures
    voice = load_voice(cfg, progress)
    worker = llm = speech = None
    try:
        if "engine" in (cfg.llm.backend, fallback and fallback.backend):
            def build() -> LLMRuntime:
                runtime = build_runtime(cfg.engine, cfg.paths.cache_dir, progress, also=also,
                                        beside=decoding_load(cfg, voice))
                progress("prefilling the system prompt once for every call's first turn ...")
                runtime.engine.keep_prefix(call_prefix(cfg, runtime.target.tokenizer, tools))
                return runtime

            worker, llm = EngineWorker.build(build, restarts=cfg.engine.worker_restarts)
        speech = SpeechModels.load(cfg, progress, llm.threads if llm else None, voice)
        if worker is not None and llm is not None:
            _share_cores(cfg, worker, llm, speech, progress)
        local = EngineChat(worker, llm.target.tokenizer) if worker is not None else None
        if tools and local is not None:
            uses = ToolPolicy(tuple(tools), cfg.agent.max_tool_calls).every_use()
            progress(f"compiling the {len(uses)} grammars of {len(tools)} tool(s) ...")
            local.prepare_tools(uses)
        chat = local if cfg.llm.backend == "engine" else _remote(cfg.llm, cfg, progress)
        if fallback is not None:
            second = local if fallback.backend == "engine" else _remote(fallback, cfg, progress)
            chat = FailoverChat(chat, second, cfg.llm.first_token_timeout_s)
    except BaseException:
        if worker is not None:
            worker.close()
        if speech is not None:
            speech.close()
        raise
    return SharedModels(llm=llm, worker=worker, chat=chat, speech=speech)


def _share_cores(cfg: Config, worker: EngineWorker, llm: LLMRuntime, speech: SpeechModels,
                 progress: Callable[[str], None]) -> None:
    """While Whisper transcribes or Piper synthesises, the engine steps on the thread count
    measured best beside Whisper (`threads_beside`). On 2 cores, a 2-thread step took 134-160 ms
    beside Whisper against 17-19 alone, and a 1-thread step 34-35 ms against 21-24 (Zen 4):
    Whisper runs at every pause, just as the prepared reply decodes its first phrase. Beside
    Piper, under four callers on an Intel Xeon, three sessions' 2-thread step took 61 ms p50
    (137 p90) against 37 (81) on the shared count, Piper's own jobs unchanged. A measurement
    that fails costs the calls this speed-up, not the start."""
    load = recognition_load(cfg, speech)
    try:
        beside = worker.call(
            lambda _: threads_beside(cfg.engine, llm, cfg.paths.cache_dir, load, progress))
    except Exception as exc:
        logger.warning(f"the engine keeps its threads while speech models run: {exc}")
        return
    if beside is not None:
        worker.share_cores(speech.busy, beside, llm.threads)
        progress(f"the engine steps on {beside} thread(s) while Whisper transcribes or Piper "
                 f"synthesises, and on {llm.threads} otherwise")


def call_prefix(cfg: Config, tokenizer, tools: list) -> list[int]:
    """What every call's prompt starts with: the system prompt, the example exchange and the
    tools, as `ChatLLMService` sends them through `EngineChat`."""
    messages = [{"role": "system", "content": cfg.agent.system_prompt},
                *cfg.agent.example_messages()]
    return encode_chat(tokenizer, messages, [t.schema for t in tools] or None)


def dtmf_aggregator(turn: TurnConfig) -> DTMFAggregator:
    # No termination key (None): only the timeout sends the keys.
    key = KeypadEntry(turn.dtmf_termination) if turn.dtmf_termination else None
    return DTMFAggregator(timeout=turn.dtmf_timeout_s, termination_digit=key)


@dataclass
class CallPipeline:
    call_id: str
    task: PipelineWorker
    clocks: ClocksObserver
    context: LLMContext
    llm: ChatLLMService


def _remote(llm: LLMConfig, cfg: Config, progress: Callable[[str], None]) -> RemoteChat:
    """A checked client of a remote server. A primary with a fallback that does not answer now
    may answer later: with `llm.model` set, it is used unchecked (the fallback serves until it
    answers)."""
    progress(f"connecting to the LLM server at {redact(llm.base_url or '')} ...")
    try:
        return connect(llm, cfg.engine.sampling)
    except RemoteLLMError as exc:
        if llm is not cfg.llm or cfg.llm.fallback is None or not llm.model or not llm.base_url:
            raise
        progress(f"warning: {exc}; starting with it unchecked: llm.fallback serves meanwhile")
        return RemoteChat(llm, llm.model, llm.name or "remote", cfg.engine.sampling)


def _utterance_end(cfg: Config, shared: SharedModels) -> UtteranceEnd | None:
    """The language model's turn cue, where it is on and used: the engine in this process, and
    the VAD's stop with a hold."""
    turn = cfg.turn
    if (shared.worker is None or shared.llm is None or turn.unfinished_logprob is None
            or turn.stop != "vad" or turn.unfinished_hold_s <= 0):
        return None
    try:
        return UtteranceEnd(shared.worker, shared.llm.target.tokenizer, turn.unfinished_logprob)
    except ValueError as exc:  # a chat template the cue cannot read: the words alone decide
        logger.warning(f"turn.unfinished_logprob is off for this call: {exc}")
        return None


def build_call(
    cfg: Config,
    shared: SharedModels,
    transport: BaseTransport,
    on_turn: Callable[[TurnRecord], None],
    call_id: str | None = None,
    method: str | None = None,
    *,
    after_input: Sequence[FrameProcessor] = (),
    before_output: Sequence[FrameProcessor] = (),
    rtvi: bool = False,
) -> CallPipeline:
    """One call's pipeline task; `method` overrides the speculation method for this call.

    `after_input` and `before_output` are transport-specific processors (an idle watchdog,
    Twilio's playback marks); `rtvi` adds pipecat's RTVI messages for a browser client.
    """
    speech = shared.speech
    if speech is None:
        raise ValueError("these shared models have no speech models: load them with load_shared")
    if (why := speech.serves(cfg)) is not None:
        raise ValueError(f"cannot build the call: {why}")
    call_id = call_id or uuid.uuid4().hex[:12]
    tools = load_tools(cfg.agent.tools)
    context = LLMContext()
    strategies = turn_strategies(cfg.turn, speech.smart_turn, _utterance_end(cfg, shared),
                                 functools.partial(takes_whole_number, tools))
    aggregators = LLMContextAggregatorPair(
        context, user_params=LLMUserAggregatorParams(user_turn_strategies=strategies))
    llm = ChatLLMService(
        shared.chat,
        session_id=call_id,
        system_prompt=cfg.agent.system_prompt,
        sampling=cfg.engine.sampling,  # this call's config's, which may differ from the engine's
        method=method,
        context=context if cfg.turn.prepare else None,
        tools=ToolPolicy(tuple(tools), cfg.agent.max_tool_calls),
        examples=cfg.agent.example_messages(),
        error_reply=cfg.agent.error_reply,
        continue_within_s=cfg.turn.continue_within_s,
    )
    register_tools(llm, tools, cfg.agent)
    recorder = call_recorder(recordings_dir(cfg), call_id) if cfg.store.audio else None
    pipeline = Pipeline([
        transport.input(),
        *([recorder.front()] if recorder else []),
        *after_input,
        PausingVADProcessor(vad_analyzer=make_vad(cfg.vad, speech.vad)),
        make_stt(cfg.asr, speech.whisper, speech.asr_worker, prepare=cfg.turn.prepare),
        # Keys pressed (Twilio `dtmf`, the page's RTVI `dtmf`) become a transcript "DTMF: 1#":
        # a user turn like a spoken one.
        dtmf_aggregator(cfg.turn),
        aggregators.user(),
        llm,
        make_tts(cfg.tts, speech.voice, speech.tts_worker,
                 functools.partial(shared.worker.hold_session, call_id) if shared.worker else None,
                 # a remote LLM's first token costs these cores nothing: no hold for it
                 speech.openings if shared.worker else None),
        HeldReplyGate(),
        *([OnsetHold(cfg.vad.start_secs + HOLD_MARGIN_S)] if cfg.turn.yield_to_voice else []),
        *before_output,
        transport.output(),
        *([recorder] if recorder else []),
        aggregators.assistant(),
    ])
    clocks = ClocksObserver(call_id, on_turn)
    task = PipelineWorker(
        pipeline,
        params=PipelineParams(enable_metrics=True, send_initial_empty_metrics=False),
        observers=[clocks],
        idle_timeout_secs=None,  # the transport decides when a call ends
        enable_rtvi=rtvi,
    )
    return CallPipeline(call_id, task, clocks, context, llm)
