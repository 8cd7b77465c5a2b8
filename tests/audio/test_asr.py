import numpy as np
import pytest

from audio.asr import StreamingTranscriber
from audio.config import ASRConfig
from tests.audio.speech import misheard, silence, speech, words

QUESTION = "What is the capital of France?"


class CountingModel:
    """A WhisperModel that counts its runs: padded (`transcribe`) and cut (the CTranslate2
    model's `generate`)."""

    def __init__(self, model):
        self._whisper = model
        self.calls = 0
        self.model = _CountingGenerate(model.model, self)

    def __getattr__(self, name):
        return getattr(self._whisper, name)

    def transcribe(self, audio, **kwargs):
        self.calls += 1
        return self._whisper.transcribe(audio, **kwargs)


class _CountingGenerate:
    def __init__(self, model, counter: CountingModel):
        self._model, self._counter = model, counter

    def __getattr__(self, name):
        return getattr(self._model, name)

    def generate(self, *args, **kwargs):
        self._counter.calls += 1
        return self._model.generate(*args, **kwargs)


@pytest.fixture
def model(whisper):
    return CountingModel(whisper)



def test_final_transcript_has_the_spoken_words(model):
    tr = StreamingTranscriber(model, ASRConfig())
    tr.feed(silence(0.3))
    tr.feed(speech(QUESTION))
    tr.feed(silence(0.5))
    final = tr.final()
    assert misheard(final.text, QUESTION) <= 1
    assert not final.reused and model.calls == 1
    assert final.window == "speech" and not final.fallback


def test_interim_transcribes_the_utterance_so_far(model):
    tr = StreamingTranscriber(model, ASRConfig())
    audio = speech("Please tell me a short fact about the moon.")
    tr.feed(audio[: len(audio) // 2])
    first = tr.interim()
    tr.feed(audio[len(audio) // 2 :])
    second = tr.interim()
    assert "please" in words(first.text) and "moon" not in words(first.text)
    assert "moon" in words(second.text)
    assert second.samples == len(audio)


def test_final_reuses_the_interim_when_no_speech_followed(model):
    tr = StreamingTranscriber(model, ASRConfig())
    tr.feed(speech(QUESTION))
    tr.feed(silence(0.1))
    interim = tr.interim()
    tr.feed(silence(0.4))  # the rest of the VAD hangover
    speech_end = tr.samples - 8000  # VAD stop minus stop_secs=0.5
    final = tr.final(speech_end)
    assert model.calls == 1  # the model did not run again
    assert final.reused and final.text == interim.text and final.model_ms == 0
    assert misheard(final.text, QUESTION) <= 1


def test_final_runs_the_model_when_speech_came_after_the_interim(model):
    tr = StreamingTranscriber(model, ASRConfig())
    audio = speech(QUESTION)
    tr.feed(audio[: len(audio) // 2])
    tr.interim()
    tr.feed(audio[len(audio) // 2 :])
    tr.feed(silence(0.5))
    final = tr.final(tr.samples - 8000)
    assert model.calls == 2 and not final.reused
    assert misheard(final.text, QUESTION) <= 1


def test_an_interim_that_hears_digits_owes_the_padded_run_to_the_pause(model):
    """With `digits_padded`: while the caller speaks, a cut run holding digits is kept as a hint
    (no padded run per interim); the transcript at the pause settles it with one padded run and
    no second cut."""
    tr = StreamingTranscriber(model, ASRConfig(digits_padded=True))
    tr.feed(speech("The order number is four eight two one three."))
    tr.feed(silence(0.1))
    interim = tr.interim()
    assert any(c.isdigit() for c in interim.text), interim
    assert (interim.window, interim.owed) == ("speech", "digits") and model.calls == 1
    assert not tr.covers()  # it cannot stand as the final
    settled = tr.interim(settle=True)
    assert (settled.window, settled.fallback, settled.owed) == ("padded", "digits", "")
    assert model.calls == 2
    final = tr.final()
    assert final.reused and final.text == settled.text and model.calls == 2


def test_digits_keep_the_cut_run_by_default(model):
    tr = StreamingTranscriber(model, ASRConfig())
    tr.feed(speech("The order number is four eight two one three."))
    final = tr.final()
    assert any(c.isdigit() for c in final.text), final
    assert (final.window, final.owed, model.calls) == ("speech", "", 1)


def test_interim_is_due_every_cadence_of_new_audio(model):
    tr = StreamingTranscriber(model, ASRConfig(interim_every_ms=300))
    tr.feed(np.zeros(4799, np.int16))
    assert not tr.interim_due()
    tr.feed(np.zeros(1, np.int16))
    assert tr.interim_due()
    tr.interim()
    assert not tr.interim_due()


def test_reset_starts_a_new_utterance(model):
    tr = StreamingTranscriber(model, ASRConfig())
    tr.feed(speech(QUESTION))
    tr.interim()
    tr.reset()
    assert tr.samples == 0 and tr.last_interim is None and tr.final().text == ""


def test_an_utterance_is_capped_and_audio_beyond_the_cap_is_dropped(model):
    tr = StreamingTranscriber(model, ASRConfig(max_utterance_s=1.0))
    chunk = np.zeros(320, np.int16)  # 20 ms at 16 kHz
    for _ in range(100):  # 2 s of audio
        tr.feed(chunk)
    assert tr.samples == 16000 and tr.dropped == 16000
    assert len(tr._chunks) == 50  # nothing, not even empty chunks, kept past the cap
    assert len(tr._snapshot(mark_interim=False)) == 16000
