"""When the caller's turn ends, and when a prepared reply stands: pipecat turn strategies.

The turn ends at the VAD stop once the final transcript is in (`vad`), or when pipecat's local
Smart Turn v3 model says the sentence is finished (`smart_turn`). With early preparation, a
reply is started from the eager transcript of the caller's first pause (see stt.py), and this
module decides its fate as pipecat's EagerUserTurnStopStrategy does: the turn end confirms it when
the committed transcript matches (pipecat's NormalizedMatch: case and punctuation aside);
otherwise, or when the caller goes on or the turn never ends, it is withdrawn with an
EagerEndOfTurnCancelFrame. pipecat's own eager strategy leaves turn detection to the STT service;
ours keeps the local one and adds the speculation to it.
"""

from __future__ import annotations

import asyncio

from loguru import logger
from pipecat.frames.frames import EagerEndOfTurnCancelFrame, EagerTranscriptionFrame, Frame
from pipecat.turns.types import ProcessFrameResult, UserTurnSpeculation
from pipecat.turns.user_start import MinWordsUserTurnStartStrategy
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

SPECULATION_TIMEOUT_S = 5.0  # a prepared reply whose turn never resolves is withdrawn


class _Preparing(BaseUserTurnStopStrategy):
    """Adds early preparation to a stop strategy that keeps the transcript in `self._text`."""

    _text: str

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._match = NormalizedMatch()
        self._speculation: UserTurnSpeculation | None = None
        self._timeout: asyncio.Task | None = None
        self._open = False  # a user turn is in progress (a backchannel over the bot is not one)

    async def process_frame(self, frame: Frame) -> ProcessFrameResult:
        if isinstance(frame, EagerTranscriptionFrame) and self._open:
            await self._speculate(frame.text)
        elif isinstance(frame, EagerEndOfTurnCancelFrame):
            await self._take()  # the STT withdrew it; the frame itself reaches the LLM
        return await super().process_frame(frame)

    async def trigger_user_turn_stopped(self, *, enable_user_speaking_frames: bool | None = None):
        speculation = await self._take()
        if speculation and self._match.matches(speculation.text, self._text):
            logger.debug(f"{self}: turn ended as prepared: committing the prepared reply")
            await self.trigger_user_turn_finalized(
                enable_user_speaking_frames=enable_user_speaking_frames,
                confirms_speculation=True,
            )
            return
        if speculation:
            logger.debug(f"{self}: transcript changed ([{speculation.text}] -> [{self._text}]): "
                         "discarding the prepared reply")
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

    async def _speculate(self, text: str) -> None:
        await self._withdraw()  # at most one prepared reply at a time
        speculation = UserTurnSpeculation(text=self._text + text)
        self._speculation = speculation
        self._timeout = self.task_manager.create_task(
            self._expire(speculation), f"{self}::prepared_reply_timeout")
        await self.trigger_user_turn_inference_triggered(speculation=speculation)

    async def _expire(self, speculation: UserTurnSpeculation) -> None:
        await asyncio.sleep(SPECULATION_TIMEOUT_S)
        self._timeout = None
        if self._speculation is speculation:
            self._speculation = None
            await self.trigger_user_turn_speculation_cancelled()

    async def _withdraw(self) -> None:
        if await self._take():
            await self.trigger_user_turn_speculation_cancelled()

    async def _take(self) -> UserTurnSpeculation | None:
        """The speculation in flight, now resolved: its timer stops."""
        speculation, self._speculation = self._speculation, None
        if self._timeout is not None:
            task, self._timeout = self._timeout, None
            await self.task_manager.cancel_task(task)
        return speculation


class PreparingSpeechTimeoutStopStrategy(_Preparing, SpeechTimeoutUserTurnStopStrategy):
    """VAD stop + final transcript ends the turn; a prepared reply is committed or withdrawn."""


class PreparingSmartTurnStopStrategy(_Preparing, TurnAnalyzerUserTurnStopStrategy):
    """Smart Turn v3 ends the turn; a prepared reply is committed or withdrawn."""


def turn_strategies(cfg: TurnConfig) -> UserTurnStrategies:
    """The user aggregator's strategies for this config."""
    start = default_user_turn_start_strategies()
    if cfg.min_interrupt_words > 1:
        # While the bot speaks, a backchannel ("mm-hmm") shorter than this does not take the
        # turn; when it is silent, one word does.
        start = [MinWordsUserTurnStartStrategy(min_words=cfg.min_interrupt_words)]
    return UserTurnStrategies(start=start, stop=[_stop_strategy(cfg)])


def _stop_strategy(cfg: TurnConfig) -> BaseUserTurnStopStrategy:
    if cfg.stop == "smart_turn":
        from pipecat.audio.turn.smart_turn.local_smart_turn_v3 import LocalSmartTurnAnalyzerV3

        analyzer = LocalSmartTurnAnalyzerV3(cpu_count=1)
        if cfg.prepare:
            return PreparingSmartTurnStopStrategy(turn_analyzer=analyzer)
        return TurnAnalyzerUserTurnStopStrategy(turn_analyzer=analyzer)
    # The VAD's stop_secs is already the hangover; waiting longer after it only adds latency,
    # and the STT's finalized transcript releases the turn at once.
    if cfg.prepare:
        return PreparingSpeechTimeoutStopStrategy(user_speech_timeout=0)
    return SpeechTimeoutUserTurnStopStrategy(user_speech_timeout=0)
