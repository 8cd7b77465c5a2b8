"""The speech window: Whisper's encoder on the utterance's own length, checked against the padded
run, on the embedded tiny.en and synthesised speech."""

import numpy as np
import pytest

from audio import whisper_window
from audio.whisper_window import repeats, segments, transcribe_padded, transcribe_speech
from tests.audio.speech import silence, speech
from voiceagent.bench.asr import normalise, word_errors

PHRASES = [
    "What time does the pharmacy open on Saturday?",
    "Tell me a short fact about the moon.",
    "My flight to Denver got cancelled. What are my options?",
    "Can you check an order for me?",
]


def words(text: str) -> list[str]:
    return [w.strip(".,?!").lower() for w in text.split()]


def as_float(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts).astype(np.float32) / 32768.0


@pytest.mark.parametrize("phrase", PHRASES)
def test_the_speech_window_transcribes_as_the_padded_one(whisper, phrase):
    audio = as_float(silence(0.3), speech(phrase), silence(0.5))
    run = transcribe_speech(whisper, audio, "en", 1, margin_ms=1000, min_ms=10000)
    padded = transcribe_padded(whisper, audio, "en", 1)
    spoken = normalise(phrase)
    # a spelling the padded run also varies on ("canceled") is one error, not a failure
    assert word_errors(spoken, normalise(run.text)) <= \
        max(word_errors(spoken, normalise(padded)), 1), (run, padded)


def test_a_doubtful_cut_run_gives_way_to_the_padded_one(whisper, monkeypatch):
    # A token budget of 2: the cut decode cannot finish, as a looping one would not.
    monkeypatch.setattr(whisper_window, "MAX_TOKENS_PER_S", 0)
    monkeypatch.setattr(whisper_window, "MAX_TOKENS_EXTRA", 2)
    audio = as_float(speech(PHRASES[1]), silence(0.3))
    run = transcribe_speech(whisper, audio, "en", 1, margin_ms=1000, min_ms=10000)
    assert (run.window, run.fallback) == ("padded", "ran past the audio")
    assert run.text == transcribe_padded(whisper, audio, "en", 1)


def test_segments_that_start_after_the_audio_are_dropped(whisper):
    """The short context's loop, as the decoder writes it with timestamps: the sentence again at
    2.00 s, after a 1.85 s clip. Only the first segment is speech."""
    from faster_whisper.tokenizer import Tokenizer

    tokenizer = Tokenizer(whisper.hf_tokenizer, False, task="transcribe", language="en")
    begin = tokenizer.timestamp_begin
    sentence = tokenizer.encode(" What is the capital of France?")
    tokens = [begin, *sentence, begin + 100, begin + 100, *sentence, begin + 200]
    starts = [start for start, _ in segments(tokens, begin)]
    assert starts == [0.0, 2.0]
    assert [seg for start, seg in segments(tokens, begin) if start < 1.85] == [sentence]


def test_the_speech_window_costs_less_than_the_padded_one(whisper):
    """The point of the cut: one encoder pass over ~3 s instead of 30 s. Counted in mel frames
    (what the encoder is given), not timed."""
    audio = as_float(speech("Tell me a short fact about the moon."))
    cut_frames = []
    real = whisper.model.generate

    def spy(features, *args, **kwargs):
        cut_frames.append(features.shape[-1])
        return real(features, *args, **kwargs)

    whisper.model = _Spy(whisper.model, spy)
    try:
        run = transcribe_speech(whisper, audio, "en", 1, margin_ms=1000, min_ms=10000)
    finally:
        whisper.model = whisper.model.wrapped
    assert run.window == "speech"
    assert cut_frames == [1000]  # 10 s of context, not 30


class _Spy:
    def __init__(self, wrapped, generate):
        self.wrapped, self.generate = wrapped, generate

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


def test_repeats_finds_the_short_context_loop():
    assert repeats("Tell me a short fact about the moon. Tell me")
    assert repeats("S S S S")
    assert repeats("Can you check order 4815 for me? Can you check order")
    assert not repeats("Can you check order 4815 for me?")
    assert not repeats("Yes.")


def test_window_lengths_come_in_steps_so_the_encoder_sees_few_shapes():
    # CTranslate2 keeps memory for every input length it has run: one per 10 ms would grow
    lengths = {whisper_window.window_frames(frames, 300, 1000, 3000) for frames in range(3000)}
    assert lengths == set(range(100, 3001, whisper_window.WINDOW_STEP_FRAMES))
    assert whisper_window.window_frames(1200, 1000, 10000, 3000) == 1300  # speech + margin
    assert whisper_window.window_frames(200, 1000, 10000, 3000) == 1000  # the minimum context
