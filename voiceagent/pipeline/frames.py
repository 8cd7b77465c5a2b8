"""Our own pipecat frames: the caller's pauses inside a turn, and a reply prepared before its turn
was confirmed (early response preparation).

pipecat's VAD reports speech start and stop; stop comes `stop_secs` (the hangover) after the last
speech. The pause frames report the first silent VAD window and the speech that ends it, so the
STT can transcribe and the LLM can start answering while the hangover runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipecat.frames.frames import AudioRawFrame, DataFrame, LLMFullResponseStartFrame, SystemFrame


def audio_seconds(frame: AudioRawFrame) -> float:
    """How long a frame's 16-bit PCM plays."""
    return len(frame.audio) / (2 * frame.num_channels * frame.sample_rate)


@dataclass
class UserSpeechPausedFrame(SystemFrame):
    """The VAD's first silent window after speech: the turn may be over (or only paused)."""


@dataclass
class UserSpeechOnsetFrame(SystemFrame):
    """Pushed just before VADUserStartedSpeakingFrame: when the caller's speech began, on the
    pipeline clock (ns): the first voiced VAD window of this speech, dated by its position in the
    caller's real-time audio stream (PausingVADProcessor). The VAD confirms speech only after
    `start_secs` of it and a smoothed volume, and a busy pipeline reaches its audio late, so its
    start frame comes hundreds of ms after the first word; a barge-in is timed from here."""

    onset_ns: int


@dataclass
class UserSpeechResumedFrame(SystemFrame):
    """Speech again after a UserSpeechPausedFrame, before the VAD reported a stop."""


@dataclass
class UserVoiceRisingFrame(SystemFrame):
    """The VAD's first voiced window after quiet: the caller may be starting to speak. The VAD
    confirms speech (VADUserStartedSpeakingFrame) only `start_secs` later, or falls back."""


@dataclass
class UserVoiceFellFrame(SystemFrame):
    """The voice of a UserVoiceRisingFrame fell quiet before the VAD confirmed it as speech."""


@dataclass
class UserWordsSoFarFrame(DataFrame):
    """The words of the caller's utterance that two interim transcripts agree on, so far: the
    LLM service prefills them while the caller speaks (incremental prefill)."""

    text: str


@dataclass
class PreparedResponseStartFrame(LLMFullResponseStartFrame):
    """Starts a reply generated from a turn that was not yet confirmed: everything it produces is
    held (voiceagent.pipeline.held_reply) until the turn ends with the same transcript."""
