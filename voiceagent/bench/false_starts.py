"""False starts in a scripted call: the bot beginning to talk inside the caller's sentence.

A caller who pauses mid-sentence ("What is the capital" / 0.7 s / "of Spain?") may be answered
once, and still hear the bot say "The" over their next words. The turn records cannot show it
(the reply was withdrawn); the call's audio can: both sides lie on one timeline (sim/call.py).
A sentence is the caller's utterances with pauses shorter than SENTENCE_PAUSE_S between them;
a false start is the bot's speech beginning (after a silence longer than a pause between its
sentences) after the sentence began and before it ended, and its length is what the caller heard
of it, to the bot's next silence. A barge-in is not one: the bot was talking before.
"""

from __future__ import annotations

import numpy as np

from voiceagent.pipeline.vad import VOICED_RMS  # a window this loud carries sound

SENTENCE_PAUSE_S = 1.0  # a pause in the script shorter than this goes on with the sentence
# Quiet this short inside the bot's speech is a pause between its words or sentences (Piper holds
# ~350 ms at a comma): the same stretch of speech, not a new start.
PAUSE_GAP_S = 0.5


def voiced_runs(samples: np.ndarray, rate: int) -> list[tuple[float, float]]:
    """(start, end) seconds of the runs of speech in `samples`, joined across pauses."""
    step = rate // 100
    n = len(samples) // step
    rms = np.sqrt(np.mean(samples[: n * step].reshape(n, step).astype(np.float64) ** 2, axis=1))
    runs: list[list[float]] = []
    for i in np.flatnonzero(rms >= VOICED_RMS):
        t = i / 100
        if runs and t - runs[-1][1] <= PAUSE_GAP_S:
            runs[-1][1] = t + 0.01
        else:
            runs.append([t, t + 0.01])
    return [(a, b) for a, b in runs]


def sentences(utterances: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """(start, end) seconds of the caller's sentences from its utterances' (start, end, pause
    after) on the call's timeline."""
    out: list[list[float]] = []
    joined = False
    for start, end, pause in utterances:
        if joined:
            out[-1][1] = end
        else:
            out.append([start, end])
        joined = pause < SENTENCE_PAUSE_S
    return [(a, b) for a, b in out]


def false_starts(bot: np.ndarray, rate: int,
                 caller_sentences: list[tuple[float, float]]) -> list[float]:
    """The ms heard of each stretch of the bot's speech that began inside a caller's sentence."""
    return [round((end - start) * 1000) for start, end in voiced_runs(bot, rate)
            if any(a < start < b for a, b in caller_sentences)]
