"""One Whisper run whose cost follows the speech: the encoder sees the utterance, not 30 s.

faster-whisper pads every input to Whisper's 30-second window (`pad_or_trim`), so a run costs the
same for a one-word answer as for a paragraph (~350 ms for tiny.en on two CPU cores). CTranslate2
itself accepts a shorter mel input, so this module cuts the features to the speech plus a margin
(at least `min_ms` of context) of the same zero frames the padded run would have seen, and
decodes that (whisper.cpp's `audio_ctx` does the same). A short context has a known failure:
the decoder, expecting more audio, repeats itself or trails off. So the decode keeps its
timestamps (a loop starts its segments after the audio ends, and those are dropped), its text is
checked, and the padded run is made instead when it repeats, runs past what the audio can hold,
or its log-probability is poor; the run says which window answered and why. Optionally
(`digits_padded`) a cut run that holds digits is redone padded too; an interim, a hint while the
caller speaks, then keeps the cut run (`settle=False`) and owes the padded one, made once at the
pause rather than at every interim.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16000
FRAMES_PER_S = 100  # Whisper's mel frames: a hop of 160 samples
# The cut window's length is rounded up to this many frames: CTranslate2 keeps ~0.4 MB for every
# input length it has seen, so a window per 10 ms frame grew a server's memory call after call;
# 0.5 s steps bound it at 60 lengths (~20 MB) for ~0.25 s more frames a run.
WINDOW_STEP_FRAMES = 50
# Speech is at most ~4 words a second, ~1.3 tokens a word (digits spoken one by one: ~1 each):
# a decode longer than this is the decoder running on past the audio.
MAX_TOKENS_PER_S = 8
MAX_TOKENS_EXTRA = 8
SECONDS_PER_TIMESTAMP = 0.02
# A poor decode. Looser than faster-whisper's -1.0 (its `log_prob_threshold`, which only starts
# its temperature fallback): a one-word answer ("Yes.") scores -0.7 to -1.2 in either window.
MIN_AVG_LOGPROB = -1.5
DIGITS = "digits"  # the doubt an unsettled run may keep


@dataclass(frozen=True)
class WhisperRun:
    text: str
    window: str  # "speech": the cut encoder answered; "padded": the 30 s window
    fallback: str = ""  # why the cut run was not kept ("" when it was, or none was tried)
    owed: str = ""  # why the padded run is still owed for this kept cut run ("" when it is not)


def transcribe_padded(model, audio: np.ndarray, language: str | None, beam_size: int) -> str:
    """faster-whisper's own run over the 30 s window; `audio` float32 at 16 kHz."""
    segments, _info = model.transcribe(
        audio,
        language=language,
        beam_size=beam_size,
        vad_filter=False,  # the pipeline's VAD already cut the utterance
        without_timestamps=True,
        condition_on_previous_text=False,
        # One decoding pass: the temperature fallback re-decodes up to five times on
        # "suspicious" output, which on a CPU costs seconds at the worst moment.
        temperature=0.0,
    )
    return " ".join(s.text.strip() for s in segments).strip()  # decodes lazily here


def transcribe_speech(model, audio: np.ndarray, language: str | None, beam_size: int,
                      margin_ms: int, min_ms: int, digits_padded: bool = False,
                      settle: bool = True) -> WhisperRun:
    """The cut run, checked; the padded run when the check fails. `model` is a
    faster_whisper.WhisperModel; `audio` float32 at 16 kHz. `digits_padded`: digits fail the
    check; `settle=False` then keeps such a run, marked `owed`."""
    import ctranslate2
    from faster_whisper.tokenizer import Tokenizer

    audio_s = len(audio) / SAMPLE_RATE
    frames = model.feature_extractor(audio)[..., :-1]  # as faster-whisper cuts its segments
    n = window_frames(frames.shape[1], margin_ms, min_ms, model.feature_extractor.nb_max_frames)
    # zero frames past the audio, as `pad_or_trim` gives the padded run
    cut = np.zeros((1, frames.shape[0], n), np.float32)
    cut[0, :, : min(n, frames.shape[1])] = frames[:, :n]
    tokenizer = Tokenizer(model.hf_tokenizer, model.model.is_multilingual, task="transcribe",
                          language=language or "en")
    # With timestamps: a loop shows itself as segments that start after the audio ends.
    prompt = model.get_prompt(tokenizer, [], without_timestamps=False)
    budget = math.ceil(audio_s * MAX_TOKENS_PER_S) + MAX_TOKENS_EXTRA
    result = model.model.generate(
        ctranslate2.StorageView.from_array(cut), [prompt], beam_size=beam_size,
        max_length=len(prompt) + budget + 1, return_scores=True,
        suppress_blank=True, suppress_tokens=[-1])[0]
    tokens = result.sequences_ids[0]
    spoken = [seg for start, seg in segments(tokens, tokenizer.timestamp_begin) if start < audio_s]
    text = tokenizer.decode([t for seg in spoken for t in seg]).strip()
    why = _doubt(text, len(tokens), budget, result.scores[0], digits_padded)
    if not why:
        return WhisperRun(text, "speech")
    if why == DIGITS and not settle:
        return WhisperRun(text, "speech", owed=why)
    return WhisperRun(transcribe_padded(model, audio, language, beam_size), "padded", why)


def window_frames(speech_frames: int, margin_ms: int, min_ms: int, max_frames: int) -> int:
    """The cut run's window in mel frames: the speech and its margin, at least `min_ms`, in
    steps of `WINDOW_STEP_FRAMES`, at most the padded window."""
    n = max(speech_frames + margin_ms * FRAMES_PER_S // 1000, min_ms * FRAMES_PER_S // 1000)
    return min(-(-n // WINDOW_STEP_FRAMES) * WINDOW_STEP_FRAMES, max_frames)


def segments(tokens: list[int], timestamp_begin: int) -> list[tuple[float, list[int]]]:
    """(start in seconds, text tokens) per segment of a decode with timestamps."""
    out: list[tuple[float, list[int]]] = []
    start, text = 0.0, []
    for token in tokens:
        if token >= timestamp_begin:
            if text:
                out.append((start, text))
            start, text = (token - timestamp_begin) * SECONDS_PER_TIMESTAMP, []
        else:
            text.append(token)
    if text:
        out.append((start, text))
    return out


def _doubt(text: str, n_tokens: int, budget: int, avg_logprob: float,
           digits_padded: bool) -> str:
    """Why a cut run's text is not to be trusted, or "" when it is."""
    if n_tokens >= budget - 1:  # CTranslate2 stops a token or two short of max_length
        return "ran past the audio"
    if repeats(text):
        return "repeats itself"
    if avg_logprob < MIN_AVG_LOGPROB:
        return f"log-probability {avg_logprob:.2f}"
    if digits_padded and any(c.isdigit() for c in text):
        return DIGITS
    return ""


def repeats(text: str) -> bool:
    """Whether the text ends in a pair of words it already said: the short context's loop
    ("Tell me about the moon. Tell me", "S S S")."""
    words = re.findall(r"[a-z0-9']+", text.lower())
    if len(words) < 3:
        return False
    tail = tuple(words[-2:])
    return any(tuple(words[i : i + 2]) == tail for i in range(len(words) - 2))
