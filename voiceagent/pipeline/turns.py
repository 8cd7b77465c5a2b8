"""When the caller's turn ends, and when a prepared reply stands: pipecat turn strategies.

The turn ends at the VAD stop once the final transcript is in (`vad`; `turn.unfinished_hold_s`
later when its words sound unfinished: "and", "the", "um", no closing punctuation, or a message
the language model expects to go on, `utterance_end.py`), or when
pipecat's local Smart Turn v3 model says the sentence is finished (`smart_turn`). With early
preparation, a reply is started from the eager transcript of the caller's first pause (see
stt.py), and this module decides its fate as pipecat's EagerUserTurnStopStrategy does: the turn
end confirms it when the committed transcript matches (pipecat's NormalizedMatch: case and
punctuation aside); otherwise, or when the caller goes on or the turn never ends, it is withdrawn
with an EagerEndOfTurnCancelFrame. pipecat's own eager strategy leaves turn detection to the STT
service; ours keeps the local one and adds the speculation to it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

from loguru import logger
from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    EagerEndOfTurnCancelFrame,
    EagerTranscriptionFrame,
    Frame,
    TranscriptionFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.turns.types import ProcessFrameResult, UserTurnSpeculation
from pipecat.turns.user_start import BaseUserTurnStartStrategy, MinWordsUserTurnStartStrategy
from pipecat.turns.user_stop import (
    BaseUserTurnStopStrategy,
    NormalizedMatch,
    SpeechTimeoutUserTurnStopStrategy,
    TurnAnalyzerUserTurnStopStrategy,
)
from pipecat.turns.user_turn_strategies import (
    UserTurnStrategies,
    default_user_turn_start_strategies,
)

from voiceagent.config import TurnConfig
from voiceagent.pipeline.utterance_end import UtteranceEnd

PREPARE_TIMEOUT_S = 5.0  # a prepared reply whose turn never resolves is withdrawn
SCORE_WAIT_S = 0.25  # the longest the turn end waits on the language model's cue
# Words a finished sentence does not end on: a caller who stops after one is thinking ("and, um").
CONTINUING = frozenset(
    "and or but so because if than then that which who to of for with from at in on by about "
    "as like the a an my your our their his her its is are was were am be i we you "
    "um uh er erm hmm".split())


UNFINISHED, UNSURE, FINISHED = "unfinished", "unsure", "finished"
# Whether the caller's words (first) end on a whole number (second, its digits): a tool takes it
# (`voiceagent.tools.takes_whole_number`).
WholeNumber = Callable[[str, str], bool]
_TRAILING_DIGITS = re.compile(r"([0-9][0-9\s,\-\u2013\u2014]*?)[.?!]*$")


def ending(text: str, whole_number: WholeNumber | None = None) -> str:
    """How the caller's words so far end: UNFINISHED on a word like "and" or "the" or a filler,
    a trailing comma or dash, or a short group of digits (a number read out in groups: "555,
    1234"); FINISHED on closing punctuation (Whisper punctuates what it hears as finished);
    UNSURE with none (Whisper also leaves the end of a finished fragment bare: "of Spain and why
    is it there"), or where closing punctuation follows a word like "you" or "that" ("Thank
    you.", "I think that."), or a question mark after a short number ("What is 2 plus 2?"): the
    language model's cue decides those, the hold without one. A number Whisper wrote with
    separators ("51,772", "3.50") is one number, not a group read out. With `whole_number`, digits
    in groups that it calls whole end the words as a word would ("the order number is 4821-3.")."""
    text = text.strip()
    if not text:
        return FINISHED
    if text.endswith(("...", "…", "-", ",")):
        return UNFINISHED
    words = re.findall(r"\d+(?:[.,]\d+)*(?![\w'])|[\w']+", text.lower())
    last = words[-1] if words else ""
    closed = text[-1] in ".?!"
    if last.isdigit() and len(last) <= 4:
        if whole_number is not None and (digits := _TRAILING_DIGITS.search(text)) and \
                whole_number(text, re.sub(r"[^0-9]", "", digits.group(1))):
            return FINISHED if closed else UNSURE
        return UNSURE if text[-1] == "?" else UNFINISHED
    if last in CONTINUING:
        return UNSURE if closed else UNFINISHED
    return FINISHED if closed else UNSURE


class _HeardWords(BaseUserTurnStopStrategy):
    """Keeps the turn's final transcript segments (`_finals`), kept before the base strategy
    sees each one. The turn's transcript is these joined by spaces, as the user aggregator writes
    it to the context (the base strategies keep their own `_text`, which one of them replaces on
    each segment)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._finals: list[str] = []

    async def process_frame(self, frame: Frame) -> ProcessFrameResult:
        if isinstance(frame, TranscriptionFrame) and frame.text.strip():
            self._finals.append(frame.text.strip())
        return await super().process_frame(frame)

    async def handle_user_turn_started(self):
        self._finals = []
        await super().handle_user_turn_started()

    async def handle_user_turn_stopped(self):
        self._finals = []
        await super().handle_user_turn_stopped()

    async def _prepare_while_deciding(self) -> None:
        """The turn may be ending on the words heard so far: start its reply now, where replies
        can be prepared (a strategy without preparation has nothing to start)."""

    async def _withdraw(self) -> None:
        """The caller went on: withdraw a prepared reply, where there is one."""


class _Preparing(_HeardWords):
    """Adds early preparation to a stop strategy."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._match = NormalizedMatch()
        self._prepared: UserTurnSpeculation | None = None
        self._timeout: asyncio.Task | None = None
        self._open = False  # a user turn is in progress (a backchannel over the bot is not one)

    async def process_frame(self, frame: Frame) -> ProcessFrameResult:
        if isinstance(frame, EagerTranscriptionFrame) and self._open:
            await self._prepare_reply(frame.text)
        elif isinstance(frame, EagerEndOfTurnCancelFrame):
            await self._take()  # the STT withdrew it; the frame itself reaches the LLM
        return await super().process_frame(frame)

    async def trigger_user_turn_stopped(self, *, enable_user_speaking_frames: bool | None = None):
        speculation = await self._take()
        if speculation and self._match.matches(speculation.text, " ".join(self._finals)):
            logger.debug(f"{self}: turn ended as prepared: committing the prepared reply")
            await self.trigger_user_turn_finalized(
                enable_user_speaking_frames=enable_user_speaking_frames,
                confirms_speculation=True,
            )
            return
        if speculation:
            logger.debug(f"{self}: transcript changed ([{speculation.text}] -> "
                         f"[{' '.join(self._finals)}]): discarding the prepared reply")
            await self.trigger_user_turn_speculation_cancelled()
        await super().trigger_user_turn_stopped(
            enable_user_speaking_frames=enable_user_speaking_frames)

    async def handle_user_turn_started(self):
        await self._withdraw()
        self._open = True
        await super().handle_user_turn_started()

    async def handle_user_turn_stopped(self):
        await self._withdraw()
        self._open = False
        await super().handle_user_turn_stopped()

    async def cleanup(self):
        await self._take()
        await super().cleanup()

    async def _prepare_reply(self, text: str) -> None:
        await self._start(UserTurnSpeculation(text=" ".join([*self._finals, text.strip()])))

    async def _prepare_while_deciding(self) -> None:
        words = " ".join(self._finals)
        if words and not (self._prepared and self._match.matches(self._prepared.text, words)):
            await self._start(UserTurnSpeculation(text=words))

    async def _start(self, speculation: UserTurnSpeculation) -> None:
        await self._withdraw()  # at most one prepared reply at a time
        self._prepared = speculation
        self._timeout = self.task_manager.create_task(
            self._expire(speculation), f"{self}::prepared_reply_timeout")
        await self.trigger_user_turn_inference_triggered(speculation=speculation)

    async def _expire(self, speculation: UserTurnSpeculation) -> None:
        await asyncio.sleep(PREPARE_TIMEOUT_S)
        self._timeout = None
        if self._prepared is speculation:
            self._prepared = None
            await self.trigger_user_turn_speculation_cancelled()

    async def _withdraw(self) -> None:
        if await self._take():
            await self.trigger_user_turn_speculation_cancelled()

    async def _take(self) -> UserTurnSpeculation | None:
        """The preparation in flight (pipecat's UserTurnSpeculation), resolved: its timer stops."""
        prepared, self._prepared = self._prepared, None
        if self._timeout is not None:
            task, self._timeout = self._timeout, None
            await self.task_manager.cancel_task(task)
        return prepared


class _HoldingUnfinished(_HeardWords):
    """Adds the transcript's own cue to a stop strategy: a turn whose words sound unfinished
    (`ending`; where the words leave it open, or with `cue_always` on every turn the engine had
    time to score, the language model's `UtteranceEnd` decides where one is given) waits
    `hold_s` more for the caller to go on before it ends, so the VAD's hangover can be short for
    a finished question and still long enough for "and, um" or "What is the capital ... of
    Spain". A caller who went on after a pause in this turn is waited on `resumed_hold_s` at
    each later pause even where the words end finished ("What is the capital ... of Spain, ...
    and why"): a hesitant caller pauses again, and a comma pause just past the VAD's stop would
    otherwise end the turn on a finished-sounding fragment. Speech in the meantime cancels the
    hold (the VAD's start resets the strategy)."""

    def __init__(self, *, hold_s: float = 0.0, resumed_hold_s: float = 0.0,
                 utterance_end: UtteranceEnd | None = None, cue_always: bool = False,
                 whole_number: WholeNumber | None = None, **kwargs):
        super().__init__(**kwargs)
        self._hold_s = hold_s
        self._resumed_hold_s = resumed_hold_s
        self._starts = 0  # the VAD's starts heard: speech resumed while a decision is awaited
        self._whole_number = whole_number  # digits a tool takes whole end the words
        self._hold: asyncio.Task | None = None
        self._utterance_end = utterance_end if hold_s > 0 else None
        self._cue_always = cue_always  # the cue also on words that end finished

    async def process_frame(self, frame: Frame) -> ProcessFrameResult:
        if isinstance(frame, VADUserStartedSpeakingFrame):
            self._starts += 1
            if self._hold is not None:  # the caller goes on: what was prepared does not stand
                await self._stop_hold()
                await self._withdraw()
            if self._utterance_end:
                self._utterance_end.warm()
        elif isinstance(frame, (EagerTranscriptionFrame, TranscriptionFrame)) and \
                self._utterance_end:
            # Scored during the hangover, on the words the turn's end will be decided on. With
            # `cue_always`, words that end finished are scored only while no reply is in flight:
            # under other callers' load the score would delay their replies (the words decide).
            words = " ".join([*self._finals, frame.text])
            end = self._ending(words)
            if end == UNSURE or (self._cue_always and end == FINISHED and
                                 self._utterance_end.idle):
                self._utterance_end.prefetch(words)
        return await super().process_frame(frame)

    async def trigger_user_turn_stopped(self, *, enable_user_speaking_frames: bool | None = None):
        text = " ".join(self._finals)
        end = self._ending(text)
        deciding = self._hold_s > 0 and (end != FINISHED or self._asks_cue(text, end))
        resumed = self._resumed_wait > 0
        starts = self._starts
        if self._hold is None and (deciding or resumed):
            # Decided in a task that is the hold from now on, so that speech resumed while the
            # score is awaited cancels the decision like the hold itself.
            if (resumed and end != UNFINISHED) or \
                    (self._asks_cue(text, end) and not self._utterance_end.ready(text)):
                await self._prepare_while_deciding()  # the reply need not wait for the hold
                if self._starts != starts:  # the caller went on meanwhile
                    await self._withdraw()
                    return
            self._hold = self.task_manager.create_task(
                self._held(text, enable_user_speaking_frames), f"{self}::unfinished_hold")
            return
        await super().trigger_user_turn_stopped(
            enable_user_speaking_frames=enable_user_speaking_frames)

    @property
    def _resumed_wait(self) -> float:
        """`resumed_hold_s` where the caller went on after words and a pause in this turn (its
        words came in two segments or more: one final a segment, none for a noise), else 0."""
        return self._resumed_hold_s if len(self._finals) >= 2 else 0.0

    async def _held(self, text: str, enable_user_speaking_frames: bool | None) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self._hold_s > 0 and await self._sounds_unfinished(text):
            logger.debug(f"{self}: the words sound unfinished: holding the turn {self._hold_s} s")
            await asyncio.sleep(self._hold_s)
        elif wait := self._resumed_wait:
            logger.debug(f"{self}: the caller went on after a pause: holding the turn {wait} s")
            # the score's wait counts towards it
            await asyncio.sleep(max(0.0, wait - (loop.time() - started)))
        # Held no more: the stop is not cancelled halfway by speech (the controller refuses a
        # stop while the caller speaks), and a refused one leaves no hold behind.
        if self._hold is asyncio.current_task():
            self._hold = None
        await super().trigger_user_turn_stopped(
            enable_user_speaking_frames=enable_user_speaking_frames)

    def _ending(self, text: str) -> str:
        return ending(text, self._whole_number)

    def _asks_cue(self, text: str, end: str) -> bool:
        """Whether the language model's cue decides these words, which end `end`: where the
        words leave it open (UNSURE), or with `cue_always` where they end finished and were
        scored (an idle engine at the pause)."""
        return self._utterance_end is not None and (end == UNSURE or (
            self._cue_always and end == FINISHED and self._utterance_end.asked(text)))

    async def _sounds_unfinished(self, text: str) -> bool:
        end = self._ending(text)
        if not self._asks_cue(text, end):
            return end != FINISHED
        try:  # the score is usually ready; an engine busy for longer must not hold the turn
            return await asyncio.wait_for(self._utterance_end.unfinished(text), SCORE_WAIT_S)
        except TimeoutError:
            logger.debug(f"{self}: no end-of-utterance score within {SCORE_WAIT_S} s")
            return end != FINISHED  # as the words alone say

    async def handle_user_turn_started(self):
        await self._stop_hold()
        await super().handle_user_turn_started()

    async def handle_user_turn_stopped(self):
        if self._hold is not asyncio.current_task():  # else the hold is what ends the turn
            await self._stop_hold()
        self._hold = None
        await super().handle_user_turn_stopped()

    async def cleanup(self):
        await self._stop_hold()
        if self._utterance_end:
            self._utterance_end.close()
        await super().cleanup()

    async def _stop_hold(self) -> None:
        if self._hold is not None:
            task, self._hold = self._hold, None
            await self.task_manager.cancel_task(task)


class HoldingSpeechTimeoutStopStrategy(_HoldingUnfinished, SpeechTimeoutUserTurnStopStrategy):
    """VAD stop + final transcript ends the turn, later when the words sound unfinished."""


class PreparingSpeechTimeoutStopStrategy(_HoldingUnfinished, _Preparing,
                                         SpeechTimeoutUserTurnStopStrategy):
    """VAD stop + final transcript ends the turn (later when the words sound unfinished); a
    prepared reply is committed or withdrawn."""


class PreparingSmartTurnStopStrategy(_Preparing, TurnAnalyzerUserTurnStopStrategy):
    """Smart Turn v3 ends the turn; a prepared reply is committed or withdrawn."""


class SustainedSpeechUserTurnStartStrategy(BaseUserTurnStartStrategy):
    """The caller takes the turn when the VAD hears speech, except over the bot: then only speech
    that lasts `min_speech_s` does (LiveKit's min_interruption_duration), so a "mm-hmm" or a
    cough does not cut the bot off. What such a backchannel transcribes to is dropped."""

    def __init__(self, *, min_speech_s: float, **kwargs):
        super().__init__(**kwargs)
        self._min_speech_s = min_speech_s
        self._bot_speaking = False
        self._timer: asyncio.Task | None = None

    async def process_frame(self, frame: Frame) -> ProcessFrameResult:
        if isinstance(frame, BotStartedSpeakingFrame):
            self._bot_speaking = True
        elif isinstance(frame, BotStoppedSpeakingFrame):
            self._bot_speaking = False
        elif isinstance(frame, VADUserStartedSpeakingFrame):
            if not self._bot_speaking:
                await self.trigger_user_turn_started()
                return ProcessFrameResult.STOP
            # The VAD confirms speech start_secs after it began.
            wait = max(0.0, self._min_speech_s - frame.start_secs)
            await self._stop_timer()
            self._timer = self.task_manager.create_task(self._sustained(wait),
                                                        f"{self}::sustained_speech")
        elif isinstance(frame, VADUserStoppedSpeakingFrame):
            await self._stop_timer()  # too short to interrupt
        elif isinstance(frame, TranscriptionFrame) and self._bot_speaking:
            await self.trigger_reset_aggregation()  # a backchannel is not the caller's turn
        return ProcessFrameResult.CONTINUE

    async def handle_user_turn_started(self):
        await self._stop_timer()

    async def cleanup(self):
        await self._stop_timer()
        await super().cleanup()

    async def _sustained(self, wait: float) -> None:
        await asyncio.sleep(wait)
        self._timer = None
        await self.trigger_user_turn_started()

    async def _stop_timer(self) -> None:
        if self._timer is not None:
            task, self._timer = self._timer, None
            await self.task_manager.cancel_task(task)


def turn_strategies(cfg: TurnConfig, smart_turn_session=None,
                    utterance_end: UtteranceEnd | None = None,
                    whole_number: WholeNumber | None = None) -> UserTurnStrategies:
    """The user aggregator's strategies for this config; `turn.stop: smart_turn` needs the
    process's Smart Turn session (`load_smart_turn_session`); `utterance_end` adds the language
    model's cue to `turn.stop: vad`'s hold, and `whole_number` ends it on a number a tool takes."""
    start = default_user_turn_start_strategies()
    if cfg.min_interrupt_s > 0 or cfg.min_interrupt_words > 1:
        # Over the bot, a backchannel ("mm-hmm") shorter than either limit does not take the
        # turn; when the bot is silent, any speech does.
        start = []
        if cfg.min_interrupt_s > 0:
            start.append(SustainedSpeechUserTurnStartStrategy(min_speech_s=cfg.min_interrupt_s))
        if cfg.min_interrupt_words > 1:
            start.append(MinWordsUserTurnStartStrategy(min_words=cfg.min_interrupt_words))
    return UserTurnStrategies(start=start,
                              stop=[_stop_strategy(cfg, smart_turn_session, utterance_end,
                                                   whole_number)])


SMART_TURN_MODEL = ("pipecat.audio.turn.smart_turn.data", "smart-turn-v3.2-cpu.onnx")


def load_smart_turn_session():
    """An ONNX session of pipecat's bundled Smart Turn v3 model, with the options pipecat's own
    analyzer uses; one per process, shared by every call (creating one takes 35 ms, too long for
    the event loop at each call; onnxruntime's Run is thread-safe)."""
    from importlib.resources import files

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    package, name = SMART_TURN_MODEL
    return ort.InferenceSession(str(files(package) / name), sess_options=options)


def _smart_turn_analyzer(session):
    """pipecat's Smart Turn v3 analyzer with its own audio state over the process's session."""
    from pipecat.audio.turn.smart_turn.base_smart_turn import BaseSmartTurn
    from pipecat.audio.turn.smart_turn.local_smart_turn_v3 import LocalSmartTurnAnalyzerV3

    class SharedSessionSmartTurn(LocalSmartTurnAnalyzerV3):
        # Its parent's constructor would load the model again; only the per-call state is new.
        def __init__(self):
            BaseSmartTurn.__init__(self)
            self._log_data = False
            self._session = session

    return SharedSessionSmartTurn()


def _stop_strategy(cfg: TurnConfig, smart_turn_session, utterance_end: UtteranceEnd | None,
                   whole_number: WholeNumber | None) -> BaseUserTurnStopStrategy:
    if cfg.stop == "smart_turn":
        if smart_turn_session is None:
            raise ValueError("turn.stop is smart_turn, but no Smart Turn model is loaded")
        analyzer = _smart_turn_analyzer(smart_turn_session)
        if cfg.prepare:
            return PreparingSmartTurnStopStrategy(turn_analyzer=analyzer)
        return TurnAnalyzerUserTurnStopStrategy(turn_analyzer=analyzer)
    # The VAD's stop_secs is already the hangover; waiting longer after it only adds latency,
    # and the STT's finalized transcript releases the turn at once, unless its words sound
    # unfinished.
    holding = {"user_speech_timeout": 0, "hold_s": cfg.unfinished_hold_s,
               "resumed_hold_s": cfg.resumed_hold_s,
               "utterance_end": utterance_end, "cue_always": cfg.unfinished_cue == "always",
               "whole_number": whole_number}
    if cfg.prepare:
        return PreparingSpeechTimeoutStopStrategy(**holding)
    return HoldingSpeechTimeoutStopStrategy(**holding)
