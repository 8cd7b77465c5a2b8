"""A turn's three clocks, measured by a pipecat observer.

1. request -> first token: the LLM service receives the context -> its first LLMTextFrame.
2. inter-token latency: the engine's per-token times (p50/p95/p99 of one turn).
3. turn end -> first audio: when the user actually stopped (VAD stop minus its stop_secs
   hangover, as pipecat's UserBotLatencyObserver does) -> BotStartedSpeakingFrame, which the
   output transport pushes when it writes the first bot audio.

All times are the pipeline clock of `FramePushed.timestamp` (ns since the task started), so the
observer's own scheduling delay never enters a measurement.

A tool turn (the LLM calls tools, and a second request answers from their results) is one turn,
with both requests' engine stats merged (`RequestStats.merge`). Its clock 1 runs from the turn's
first request to the first token of speech, and clock 3 to the reply's first audio: both span the
tool calls, since the caller waits through them. A filler spoken while a slow tool runs stops
neither (it is `breakdown.filler_audio_ms`); the breakdown splits the wait into the LLM choosing
the tools, the tools, and the answering request to its first token, and `tool_calls` has each
call.

Early preparation: a reply prepared at the caller's pause belongs to the turn still being heard;
if the turn is confirmed (UserStoppedSpeakingFrame) it becomes the answer, and clock 1 counts
from the preparation's request. A withdrawn one (EagerEndOfTurnCancelFrame) leaves only its
waste on the turn: the tokens generated and the audio synthesised for nobody.

An early end: a turn that ended at a pause (a comma the hangover did not outlast) and whose reply
the caller interrupted before any of it was heard is kept back. If the caller went on with it
(continuation.py joins the two for the model) it becomes the start of the next turn's record:
one sentence, one answer, one record, counted in `early_ends`; otherwise it is written alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    EagerEndOfTurnCancelFrame,
    FunctionCallCancelFrame,
    FunctionCallInProgressFrame,
    FunctionCallResultFrame,
    InputDTMFFrame,
    InterruptionFrame,
    LLMContextFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    MetricsFrame,
    OutputAudioRawFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSTextFrame,
    UserStoppedSpeakingFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.services.llm_service import LLMService
from pipecat.services.tts_service import TTSService
from pipecat.transports.base_output import BaseOutputTransport

from voiceagent.pipeline.frames import UserSpeechOnsetFrame, audio_seconds
from voiceagent.pipeline.metrics import (
    ASRFinalMetricsData,
    EngineStatsMetricsData,
    HeldAudioMetricsData,
    RequestStartedMetricsData,
    TurnContinuesMetricsData,
)
from voiceagent.pipeline.turn_record import (
    Breakdown,
    Clocks,
    Percentiles,
    Preparation,
    ToolCall,
    TurnRecord,
    TurnStats,
)


@dataclass
class _ToolRun:
    name: str
    started_ns: int
    ended_ns: int | None = None  # its final result, or its cancellation
    result_chars: int | None = None
    ok: bool = False
    awaits_reply: bool = True  # its result goes to the LLM (not: a template spoke it, a hang-up)

    def finish(self, ts: int, frame: FunctionCallResultFrame) -> None:
        self.ended_ns = ts
        properties = frame.properties
        self.awaits_reply = not (frame.run_llm is False or (
            properties is not None and properties.run_llm is False))
        # As the assistant aggregator writes it into the context.
        self.result_chars = len(json.dumps(frame.result, ensure_ascii=False, default=str))
        failed = isinstance(frame.result, dict) and "error" in frame.result
        self.ok = frame.error is None and not failed

    def record(self) -> ToolCall:
        return ToolCall(self.name, _ms(self.started_ns, self.ended_ns), self.result_chars,
                        self.ok, cancelled=self.result_chars is None)


@dataclass
class _Turn:
    started_ns: int
    started_wall: float
    user_text: list[str] = field(default_factory=list)
    keys: bool = False  # opened by a key press (DTMF), not by speech
    vad_stop_ns: int | None = None
    hangover_s: float = 0.0
    transcript_ns: int | None = None
    asr_final_ms: float | None = None
    request_ns: int | None = None  # the turn's first request: clock 1 starts there
    latest_request_ns: int | None = None
    reply_ns: int | None = None  # the request answering tool results, if its text came first
    requests: int = 0
    reported: int = 0  # requests whose engine stats are in
    # requests started for it since its last drop, in order: the last one's stats are the turn's
    own_requests: list[str] = field(default_factory=list)
    tool_calls: dict[str, _ToolRun] = field(default_factory=dict)  # by tool_call_id
    filler_audio_ns: int | None = None
    first_token_ns: int | None = None
    llm_text: list[str] = field(default_factory=list)
    tts_started_ns: int | None = None
    tts_first_chunk_ns: int | None = None
    first_audio_ns: int | None = None
    spoken: list[str] = field(default_factory=list)  # clauses the transport played to the end
    # Clauses the TTS synthesised and the transport has not played to the end, with their
    # audio's length; the first is playing, `played_s` into it.
    unplayed: list[tuple[str, float]] = field(default_factory=list)
    clause_audio_s: float = 0.0  # synthesised for the clause whose text has not come yet
    played_s: float = 0.0
    tts_contexts: set[str] = field(default_factory=set)  # the TTS contexts of this reply
    engine: TurnStats | None = None
    interrupted_ns: int | None = None
    barge_in_ns: int | None = None  # the caller started speaking over this reply
    audio_stopped_ns: int | None = None
    # The output transport took the interruption: it dropped its queued audio (on Twilio, sent
    # the `clear`). The bot is silent once this and its BotStoppedSpeakingFrame have both come.
    dropped_ns: int | None = None
    speaking: bool = False
    audio_s: float = 0.0  # synthesised for this turn's reply
    prepared_ns: int | None = None  # the request of the preparation in flight or committed
    preparation: Preparation = field(default_factory=Preparation)
    continues: bool = False  # goes on with the turn before (TurnContinuesMetricsData)
    early_ends: int = 0  # turns absorbed: ended at a pause, their reply withdrawn unheard
    absorbed_text: str = ""  # their words, before this turn's own

    @property
    def withdrawn_unheard(self) -> bool:
        """Interrupted before any of its reply (or a filler) was heard, with no tool run: the
        caller may be going on with it, and then it is part of the next turn (`absorb`)."""
        return (self.interrupted_ns is not None and self.first_audio_ns is None
                and self.filler_audio_ns is None and not self.tool_calls)

    def absorb(self, earlier: _Turn) -> None:
        """Take in a turn the caller went on from before hearing its reply: one sentence, one
        answer, so one record. Its words come first, its withdrawn reply's work is waste, and
        the caller's speech began with it."""
        self.started_ns, self.started_wall = earlier.started_ns, earlier.started_wall
        self.absorbed_text = " ".join(t for t in (earlier.absorbed_text, *earlier.user_text) if t)
        self.early_ends += earlier.early_ends + 1
        self.continues = earlier.continues
        mine, theirs = self.preparation, earlier.preparation
        mine.prepared += theirs.prepared
        mine.discarded += theirs.discarded + 1
        mine.discarded_tokens += theirs.discarded_tokens + (
            earlier.engine.generated_tokens if earlier.engine else 0)
        mine.discarded_audio_ms += theirs.discarded_audio_ms + earlier.audio_s * 1000

    def drop_reply(self) -> None:
        """Forget a withdrawn prepared reply: the turn is being heard again."""
        self.request_ns = self.first_token_ns = self.prepared_ns = None
        self.latest_request_ns = self.reply_ns = None
        self.tts_started_ns = self.tts_first_chunk_ns = None
        self.llm_text, self.engine, self.audio_s, self.own_requests = [], None, 0.0, []
        self.unplayed, self.clause_audio_s, self.tts_contexts = [], 0.0, set()
        self.requests = self.reported = 0
        self.tool_calls = {}

    def request(self, ts: int) -> None:
        """A request for this turn's reply went out."""
        self.latest_request_ns = ts
        self.requests += 1

    @property
    def tools_pending(self) -> bool:
        """A tool call runs, or ended after the latest request: its result awaits a request."""
        latest = self.latest_request_ns or 0
        return any(run.ended_ns is None or (run.awaits_reply and run.ended_ns > latest)
                   for run in self.tool_calls.values())

    @property
    def complete(self) -> bool:
        """The LLM finished and the bot's audio has stopped; after tool calls, the LLM's reply to
        their results too (unless the caller cut the turn short)."""
        waiting = self.interrupted_ns is None and bool(self.tool_calls) and (
            self.tools_pending or self.reported < self.requests)
        dropping = self.interrupted_ns is not None and self.dropped_ns is None and (
            self.first_audio_ns is not None)
        return self.engine is not None and not self.speaking and not waiting and not dropping and (
            self.first_audio_ns is not None or self.interrupted_ns is not None
        )

    @property
    def silent_ns(self) -> int | None:
        """When the bot's audio stopped after a barge-in: its BotStoppedSpeakingFrame, or the
        transport dropping its queue (the `clear`) if that came later."""
        ends = [t for t in (self.audio_stopped_ns, self.dropped_ns) if t is not None]
        return max(ends) if self.audio_stopped_ns is not None and ends else None

    @property
    def heard_text(self) -> str:
        """What the caller heard: the clauses played to the end, and of the clause cut off by a
        barge-in, its words in proportion to the share of its audio that was played."""
        words = [w.strip() for w in self.spoken if w.strip()]
        if self.interrupted_ns is not None and self.unplayed:
            text, audio_s = self.unplayed[0]
            share = min(1.0, self.played_s / audio_s) if audio_s > 0 else 0.0
            words.append(heard_part(text, share))
        return " ".join(w for w in words if w)

    @property
    def turn_end_ns(self) -> int | None:
        if self.vad_stop_ns is None:
            return None
        return self.vad_stop_ns - int(self.hangover_s * 1e9)


def heard_part(text: str, share: float) -> str:
    """The words of `text` whose end lies within the first `share` of it, by characters: speech
    runs at a near-constant rate of characters, so a clause's audio is cut at the same share."""
    cut = share * len(text)
    heard, end = [], 0
    for word in text.split():
        end = text.index(word, end) + len(word)
        if end > cut:
            break
        heard.append(word)
    return " ".join(heard)


def _ms(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None else (b - a) / 1e6


_TOOL_FRAMES = (FunctionCallInProgressFrame, FunctionCallResultFrame, FunctionCallCancelFrame)


def _ends_with_tool_result(messages: list) -> bool:
    """A context the assistant aggregator pushed with a tool's result, for the LLM to answer."""
    last = messages[-1] if messages else None
    return isinstance(last, dict) and last.get("role") == "tool"


def _tool_segments(turn: _Turn) -> tuple[float | None, float | None]:
    """Breakdown.tool_call_ms and tools_ms: only for tools that ran before the first token of
    speech, on the way to the first audio."""
    starts = [run.started_ns for run in turn.tool_calls.values()]
    if not starts or (turn.first_token_ns is not None and turn.first_token_ns < min(starts)):
        return None, None
    return _ms(turn.request_ns, min(starts)), _ms(min(starts), turn.reply_ns)


class ClocksObserver(BaseObserver):
    """Watches a call's frames and emits a TurnRecord per answered turn to `on_turn`.

    A barge-in starts the next turn while the previous reply is still being cut off, so the
    previous turn stays open ("answering") until its audio stops, and the frames of the reply
    (text, TTS, interruption, engine stats) go to whichever turn is answering.
    """

    def __init__(self, call_id: str, on_turn: Callable[[TurnRecord], None], **kwargs):
        super().__init__(**kwargs)
        self.call_id = call_id
        self._on_turn = on_turn
        self._listening: _Turn | None = None  # the user is speaking; no request yet
        self._answering: _Turn | None = None  # the request went out; the bot replies
        self._preparing: _Turn | None = None  # being heard, with a prepared reply in flight
        self._llm_stale = False  # the LLM still pushes a withdrawn reply's frames
        self._count = 0
        self._user_speaking = False
        self._onset_ns: int | None = None  # the latest UserSpeechOnsetFrame's, until its start
        self._withdrawn_tts: set[str] = set()  # TTS contexts of withdrawn replies
        # A turn whose reply was withdrawn unheard, kept until the next turn says whether the
        # caller went on with it (`_Turn.absorb`) or not (then it is a record of its own).
        self._unheard: _Turn | None = None
        self._started: dict[str, _Turn] = {}  # the turn each request in flight began for

    @property
    def idle(self) -> bool:
        """Nobody is speaking and no reply is on its way."""
        return self._answering is None and not self._user_speaking

    async def on_push_frame(self, data: FramePushed) -> None:
        frame, src, ts = data.frame, data.source, data.timestamp
        if isinstance(frame, LLMContextFrame):
            if isinstance(data.destination, LLMService):
                if frame.speculation:
                    self._prepare(ts, frame.context.get_messages())
                else:
                    self._request(ts, frame.context.get_messages())
            return
        if isinstance(src, BaseOutputTransport) and isinstance(frame, (TTSTextFrame,
                                                                      OutputAudioRawFrame)):
            self._played(frame)  # what the transport played (audio it chunked anew, or not)
            return
        if isinstance(src, BaseOutputTransport) and isinstance(frame, InterruptionFrame):
            self._dropped(ts)  # the interruption reached the transport (not a first push)
            return
        if not data.first_push:
            return
        if isinstance(frame, UserSpeechOnsetFrame):
            self._onset_ns = frame.onset_ns
        elif isinstance(frame, VADUserStartedSpeakingFrame):
            self._user_speaking = True
            # The speech began at its first voiced frame; without one, start_secs before the VAD
            # could confirm it.
            onset, self._onset_ns = self._onset_ns, None
            began = onset if onset is not None else ts - int(frame.start_secs * 1e9)
            reply = self._answering
            if reply is not None and not reply.complete and reply.interrupted_ns is None:
                # The latest speech over the reply (a backchannel before it did not take the
                # turn).
                reply.barge_in_ns = began
            if self._listening is None:
                start = ts if onset is None else onset
                self._listening = _Turn(started_ns=start,
                                        started_wall=time.time() - (ts - start) / 1e9)
        elif isinstance(frame, VADUserStoppedSpeakingFrame):
            self._user_speaking = False
            if self._listening is None:
                return
            self._listening.vad_stop_ns, self._listening.hangover_s = ts, frame.stop_secs
        elif isinstance(frame, InputDTMFFrame) and self._listening is None:
            # Keys alone make a turn too: pipecat's DTMFAggregator sends them as its transcript.
            self._listening = _Turn(started_ns=ts, started_wall=time.time(), keys=True)
        elif isinstance(frame, TranscriptionFrame) and self._listening:
            self._listening.user_text.append(frame.text.strip())
            self._listening.transcript_ns = ts
            if self._listening.keys and self._listening.vad_stop_ns is None:
                # No speech to end: the turn ends when the keys are sent.
                self._listening.vad_stop_ns, self._listening.hangover_s = ts, 0.0
        elif isinstance(frame, MetricsFrame):
            self._metrics(frame)
        elif isinstance(frame, EagerEndOfTurnCancelFrame):
            self._discard()
        elif isinstance(frame, UserStoppedSpeakingFrame):
            self._commit()
        elif isinstance(frame, _TOOL_FRAMES):
            if isinstance(src, LLMService):  # where the calls run, not a hop on their way
                self._tool_frame(frame, ts)
        elif isinstance(src, (LLMService, TTSService)) and self._from_withdrawn(frame, src):
            return
        elif self._preparing is not None and isinstance(src, (LLMService, TTSService)):
            self._reply_frame(self._preparing, frame, src, ts)
        elif self._answering is not None:
            self._reply_frame(self._answering, frame, src, ts)

    def _prepare(self, ts: int, messages: list) -> None:
        turn = self._listening
        if turn is None:
            return
        turn.drop_reply()
        turn.request_ns = turn.prepared_ns = ts
        turn.request(ts)
        turn.preparation.prepared += 1
        last = messages[-1] if messages else {}
        turn.preparation.prepared_text = last.get("content") if isinstance(last, dict) else None
        self._preparing = turn

    def _from_withdrawn(self, frame, src) -> bool:
        """Whether a frame of the LLM or the TTS belongs to a withdrawn reply. The LLM passes the
        withdrawal on after pushing what it had, and its next reply starts with a Start; the
        TTS's frames carry their context, and a new reply's may come before its Start (which
        waits behind the audio contexts queued before it)."""
        if isinstance(src, TTSService):
            return getattr(frame, "context_id", None) in self._withdrawn_tts
        if isinstance(frame, LLMFullResponseStartFrame):
            self._llm_stale = False
        return self._llm_stale

    def _discard(self) -> None:
        turn, self._preparing = self._preparing, None
        if turn is not None:
            self._llm_stale = True
            self._withdrawn_tts |= turn.tts_contexts
            turn.preparation.discarded += 1
            # Its stats are in when it had finished generating before the withdrawal.
            if turn.engine is not None:
                turn.preparation.discarded_tokens += turn.engine.generated_tokens
            turn.drop_reply()

    def _commit(self) -> None:
        """The turn is confirmed with its prepared reply: that reply is the answer."""
        turn, self._preparing = self._preparing, None
        if turn is None or turn is not self._listening:
            return
        turn.preparation.committed = True
        if self._answering is not None:
            self._emit(self._answering)
        self._answering, self._listening = turn, None
        self._emit_if_complete()

    def _request(self, ts: int, messages: list) -> None:
        answering = self._answering
        if answering is not None and answering.tools_pending and (
                self._listening is None or _ends_with_tool_result(messages)):
            # The reply to the tool results: still this turn, even if the caller has started
            # speaking meanwhile (their turn's context would end with their words).
            answering.reply_ns = ts if answering.first_token_ns is None else answering.reply_ns
            answering.request(ts)
            return
        self._preparing = None
        turn = self._listening
        if turn is None:  # a context without a new user turn (e.g. a re-run): keep answering
            if answering is not None:
                answering.request_ns = ts
                answering.request(ts)
            return
        if answering is not None:
            self._emit(answering)
        turn.request_ns = ts
        turn.request(ts)
        self._answering, self._listening = turn, None

    def _tool_frame(self, frame, ts: int) -> None:
        """A tool call starts (on the turn the LLM replies for), ends, or is cancelled. The LLM
        broadcasts each frame both ways: the call's id counts it once."""
        if isinstance(frame, FunctionCallInProgressFrame):
            if (turn := self._preparing or self._answering) is not None:
                turn.tool_calls.setdefault(frame.tool_call_id, _ToolRun(frame.function_name, ts))
            return
        turns = (t for t in (self._answering, self._preparing) if t is not None)
        run = next((t.tool_calls[frame.tool_call_id] for t in turns
                    if frame.tool_call_id in t.tool_calls), None)
        if run is None or run.ended_ns is not None:
            return
        if isinstance(frame, FunctionCallCancelFrame):
            run.ended_ns = ts
            self._emit_if_complete()
        elif frame.properties is None or frame.properties.is_final:  # not a progress update
            run.finish(ts, frame)

    def _dropped(self, ts: int) -> None:
        turn = self._answering
        if turn is not None and turn.interrupted_ns is not None and turn.dropped_ns is None:
            turn.dropped_ns = ts
            self._emit_if_complete()

    def _played(self, frame) -> None:
        """The output transport played a clause to its end (its text), or some audio."""
        turn = self._answering
        if turn is None:
            return
        if isinstance(frame, TTSTextFrame):
            turn.spoken.append(frame.text)
            turn.unplayed[:1] = []
            turn.played_s = 0.0
        else:
            turn.played_s += audio_seconds(frame)

    def _reply_frame(self, turn: _Turn, frame, src, ts: int) -> None:
        if isinstance(src, TTSService) and getattr(frame, "context_id", None):
            turn.tts_contexts.add(frame.context_id)
        if turn.tool_calls and turn.first_token_ns is None and self._filler(turn, frame, src, ts):
            return
        if isinstance(frame, LLMTextFrame) and isinstance(src, LLMService):
            turn.first_token_ns = turn.first_token_ns or ts
            turn.llm_text.append(frame.text)
        elif isinstance(frame, TTSStartedFrame) and isinstance(src, TTSService):
            turn.tts_started_ns = turn.tts_started_ns or ts
        elif isinstance(frame, TTSAudioRawFrame) and isinstance(src, TTSService):
            turn.tts_first_chunk_ns = turn.tts_first_chunk_ns or ts
            turn.audio_s += audio_seconds(frame)
            turn.clause_audio_s += audio_seconds(frame)
        elif isinstance(frame, TTSTextFrame) and isinstance(src, TTSService):
            # A clause's text follows its audio.
            turn.unplayed.append((frame.text, turn.clause_audio_s))
            turn.clause_audio_s = 0.0
        elif isinstance(frame, BotStartedSpeakingFrame) and isinstance(src, BaseOutputTransport):
            turn.speaking = True
            turn.first_audio_ns = turn.first_audio_ns or ts
        elif isinstance(frame, BotStoppedSpeakingFrame) and isinstance(src, BaseOutputTransport):
            turn.speaking = False
            if turn.interrupted_ns is not None and turn.audio_stopped_ns is None:
                turn.audio_stopped_ns = ts
            self._emit_if_complete()
        elif isinstance(frame, InterruptionFrame) and turn.interrupted_ns is None:
            if not turn.complete:
                turn.interrupted_ns = ts

    @staticmethod
    def _filler(turn: _Turn, frame, src, ts: int) -> bool:
        """Whether `frame` is of a filler spoken while the tools run, before the reply has a token:
        it starts neither the reply's TTS clocks nor its audio (clock 3)."""
        if isinstance(frame, BotStartedSpeakingFrame) and isinstance(src, BaseOutputTransport):
            turn.speaking = True
            turn.filler_audio_ns = turn.filler_audio_ns or ts
            return True
        return isinstance(frame, (TTSStartedFrame, TTSAudioRawFrame)) and isinstance(
            src, TTSService)

    def _metrics(self, frame: MetricsFrame) -> None:
        for item in frame.data:
            if isinstance(item, RequestStartedMetricsData):
                if (turn := self._replying(item.prepared)) is not None:
                    self._started[item.request_id] = turn
                    if not item.prepared or turn is self._preparing:  # its own, not a stray
                        turn.own_requests.append(item.request_id)
            elif isinstance(item, EngineStatsMetricsData) and item.discarded:
                self._started.pop(item.request_id, None)
                if (turn := self._listening or self._answering) is not None:
                    turn.preparation.discarded_tokens += item.stats.generated_tokens
            elif isinstance(item, EngineStatsMetricsData):
                turn = self._owner(item)
                if turn is None:
                    continue
                latest = turn.own_requests[-1] if turn.own_requests else item.request_id
                if not turn.tool_calls and item.request_id != latest:
                    # A request the turn went on from (its preparation superseded, a re-run),
                    # cancelled: its work is waste, and its stats, however late they come
                    # (a remote server's cancel on a loaded machine), are not the answer's.
                    turn.preparation.discarded_tokens += item.stats.generated_tokens
                    if item.request_id in turn.own_requests:  # one of `requests`: it reported
                        turn.reported += 1
                        self._emit_if_complete()
                    continue
                stats = TurnStats.of(item.stats, request_id=item.request_id,
                                     interrupted=item.interrupted, error=item.error)
                # A tool turn's requests are one turn's work.
                merge = turn.engine is not None and turn.tool_calls
                turn.engine = turn.engine.merge(stats) if merge else stats
                turn.reported += 1
                self._emit_if_complete()
            elif isinstance(item, HeldAudioMetricsData):
                if (turn := self._listening or self._answering) is not None:
                    turn.preparation.discarded_audio_ms += item.discarded_audio_ms
            elif isinstance(item, TurnContinuesMetricsData):
                # A prepared reply's turn is still being heard; a committed one is answered.
                if (turn := self._listening or self._answering) is not None:
                    turn.continues = True
            elif isinstance(item, ASRFinalMetricsData):
                target = self._listening or self._answering
                if target is not None:
                    target.asr_final_ms = item.final_ms

    def _replying(self, prepared: bool) -> _Turn | None:
        """The turn a request that starts now replies to. A prepared reply may also finish
        generating before its turn is confirmed."""
        return self._preparing if prepared and self._preparing else self._answering

    def _owner(self, item: EngineStatsMetricsData) -> _Turn | None:
        """The turn a request's stats belong to: the one it began for, if that turn is not
        written yet (none once it was written without them), else the one replying now."""
        if item.request_id not in self._started:
            return self._replying(item.prepared)
        turn = self._started.pop(item.request_id)
        return turn if any(turn is t for t in (self._answering, self._preparing,
                                               self._unheard)) else None

    def _emit_if_complete(self) -> None:
        if self._answering is not None and self._answering.complete:
            self._emit(self._answering)
            self._answering = None

    def flush(self) -> None:
        """Emit the turn being answered, and one kept for the next (the call ended)."""
        if self._answering is not None:
            self._emit(self._answering)
            self._answering = None
        if self._unheard is not None:
            self._write(self._unheard)
            self._unheard = None

    def _emit(self, turn: _Turn) -> None:
        """Write `turn`'s record after the one kept before it, or absorb that one when the
        caller went on with it; keep `turn` instead when its reply went unheard."""
        earlier, self._unheard = self._unheard, None
        if earlier is not None and turn.continues:
            turn.absorb(earlier)
        elif earlier is not None:
            self._write(earlier)
        if turn.withdrawn_unheard:
            self._unheard = turn
        else:
            self._write(turn)

    def _write(self, turn: _Turn) -> None:
        self._count += 1
        engine = turn.engine
        preparation = turn.preparation
        if preparation.committed:
            preparation.lead_ms = _ms(turn.prepared_ns, turn.vad_stop_ns)
        if preparation.prepared_text is not None and turn.absorbed_text:
            # Prepared from the context, whose last message holds only this turn's own words.
            preparation.prepared_text = f"{turn.absorbed_text} {preparation.prepared_text}"
        preparation.answer_tokens = engine.generated_tokens if engine else 0
        preparation.answer_audio_ms = turn.audio_s * 1000
        tool_call_ms, tools_ms = _tool_segments(turn)
        record = TurnRecord(
            call_id=self.call_id,
            turn=self._count,
            started_at=turn.started_wall,
            user_text=" ".join(t for t in (turn.absorbed_text, *turn.user_text) if t),
            bot_text=turn.heard_text,
            llm_text="".join(turn.llm_text),
            interrupted=turn.interrupted_ns is not None,
            clocks=Clocks(
                request_to_first_token_ms=_ms(turn.request_ns, turn.first_token_ns),
                itl_ms=Percentiles.of(engine.itl_ms if engine else []),
                turn_end_to_first_audio_ms=_ms(turn.turn_end_ns, turn.first_audio_ns),
            ),
            breakdown=Breakdown(
                user_speech_ms=_ms(turn.started_ns, turn.turn_end_ns),
                vad_hangover_ms=turn.hangover_s * 1000 if turn.vad_stop_ns else None,
                asr_final_ms=turn.asr_final_ms,
                transcript_to_request_ms=_ms(turn.transcript_ns, turn.request_ns),
                tool_call_ms=tool_call_ms,
                tools_ms=tools_ms,
                prefill_ms=engine.prefill_ms if engine else None,
                first_token_ms=_ms(turn.reply_ns or turn.request_ns, turn.first_token_ns),
                first_clause_ms=_ms(turn.first_token_ns, turn.tts_started_ns),
                tts_first_chunk_ms=_ms(turn.tts_started_ns, turn.tts_first_chunk_ns),
                chunk_to_audio_ms=_ms(turn.tts_first_chunk_ns, turn.first_audio_ns),
                filler_audio_ms=_ms(turn.turn_end_ns, turn.filler_audio_ns),
            ),
            engine=engine,
            barge_in_to_silence_ms=(
                _ms(turn.barge_in_ns, turn.silent_ns) if turn.interrupted_ns else None
            ),
            barge_in_detection_ms=(
                _ms(turn.barge_in_ns, turn.interrupted_ns) if turn.silent_ns else None
            ),
            interruption_to_silence_ms=_ms(turn.interrupted_ns, turn.silent_ns),
            preparation=preparation,
            tool_calls=[run.record() for run in turn.tool_calls.values()],
            continues=turn.continues,
            early_ends=turn.early_ends,
        )
        self._on_turn(record)
