"""`bench call` variants: what each name turns on, and clear errors for bad ones."""

import numpy as np
import pytest

from audio.config import TTSConfig
from voiceagent.bench.call import (
    Variant,
    caller_audio,
    parse_backends,
    render_tool_turns,
    speech_per_variant,
    tool_turns,
)
from voiceagent.bench.false_starts import false_starts, sentences, voiced_runs
from voiceagent.config import ConfigError, load_config
from voiceagent.pipeline.speech_models import SpeechModels
from voiceagent.pipeline.tts import load_tts_voice


def test_variant_turns_on_its_features_and_only_those():
    cfg = load_config(None, ["turn.prepare=true", "turn.stop=smart_turn"])
    plain = Variant.parse("ngram").configure(cfg)
    assert not plain.turn.prepare and plain.turn.stop == "vad"
    both = Variant.parse("off+prepare+smart_turn").configure(cfg)
    assert both.turn.prepare and both.turn.stop == "smart_turn"
    assert Variant.parse("off+prepare+smart_turn").method == "off"


def test_variant_overrides_apply_to_its_copy_of_the_config():
    cfg = load_config()
    variant = Variant.parse("off+prepare:vad.stop_secs=0.7:tts.cpu_threads=1")
    changed = variant.configure(cfg)
    assert (changed.vad.stop_secs, changed.tts.cpu_threads) == (0.7, 1)
    assert cfg.vad.stop_secs == 0.3 and cfg.tts.cpu_threads == 0  # the base is untouched


def test_a_variant_that_changes_the_speech_models_runs_on_its_own():
    cfg = load_config()
    shared = SpeechModels.load(load_config(None, ["turn.stop=smart_turn"]), lambda _: None)
    variants = [Variant.parse(n) for n in ("ngram+prepare+smart_turn", "off",
                                           "off:tts.cpu_threads=1", "ngram:tts.cpu_threads=1")]
    speech = speech_per_variant(cfg, variants, shared, lambda _: None)
    assert speech["ngram+prepare+smart_turn"] is speech["off"] is shared
    own = speech["off:tts.cpu_threads=1"]
    assert own is not shared and own is speech["ngram:tts.cpu_threads=1"]  # loaded once
    assert own.settings["tts.cpu_threads"] == 1
    assert all(speech[v.name].serves(v.configure(cfg)) is None for v in variants)


def test_unknown_feature_or_key_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="features: prepare, smart_turn"):
        Variant.parse("ngram+turbo")
    with pytest.raises(ConfigError, match="valid keys"):
        Variant.parse("off:vad.nope=1").configure(load_config())


def test_backends_are_named_urls_and_a_bad_one_says_the_form():
    assert parse_backends(["vllm=http://127.0.0.1:8000/v1", "sglang=https://h/v1"]) == {
        "vllm": "http://127.0.0.1:8000/v1", "sglang": "https://h/v1"}
    for bad in ("http://127.0.0.1:8000/v1", "vllm=127.0.0.1:8000", "=http://h/v1"):
        with pytest.raises(ValueError, match="expected NAME=URL"):
            parse_backends([bad])


def _turn(c3: float | None, calls: list[dict], interrupted: bool = False) -> dict:
    return {"clocks": {"turn_end_to_first_audio_ms": c3}, "tool_calls": calls,
            "interrupted": interrupted}


def test_tool_turns_count_results_heard_within_a_second():
    ok = {"name": "lookup_order", "duration_ms": 20.0, "ok": True}
    failed = {"name": "lookup_order", "duration_ms": 5000.0, "ok": False}
    turns = [_turn(800.0, [ok]), _turn(1400.0, [ok, failed]), _turn(300.0, []),
             _turn(200.0, [ok], interrupted=True)]

    summary = tool_turns(turns)
    assert (summary["turns"], summary["calls"], summary["failed"]) == (2, 3, 1)
    assert summary["within_goal"] == 1 and summary["c3_p50"] == 1100.0
    table = render_tool_turns({"ngram": summary})
    assert "| ngram | 2 | 3 (1) | 1100 / 1370 | 20 | 1 of 2 |" in table


def _tone(seconds: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (8000 * np.sin(2 * np.pi * 220 * t)).astype(np.int16)


def _bot(rate: int, *spans: tuple[float, float]) -> np.ndarray:
    out = np.zeros(int(6 * rate), np.int16)
    for a, b in spans:
        out[int(a * rate):int(a * rate) + int((b - a) * rate)] = _tone(b - a, rate)
    return out


def test_a_pause_shorter_than_a_second_goes_on_with_the_sentence():
    assert sentences([(0.5, 1.5, 0.7), (2.2, 3.0, 0.3), (3.3, 4.0, 5.0), (9.0, 10.0, 5.0)]) == [
        (0.5, 4.0), (9.0, 10.0)]


def test_false_starts_are_the_bots_speech_begun_inside_the_callers_sentence():
    said = [(0.5, 4.0)]
    heard = false_starts(_bot(16000, (2.0, 2.3), (4.5, 5.5)), 16000, said)
    assert heard == [300]  # the reply after the sentence is not one
    assert false_starts(_bot(16000, (0.0, 1.0)), 16000, said) == []  # talking before: a barge-in
    # ... even when the caller begins in the pause between two of the bot's sentences
    assert false_starts(_bot(16000, (0.0, 0.4), (0.75, 1.5)), 16000, said) == []


def test_the_scripted_callers_hesitation_is_one_sentence_on_its_timeline():
    voice = load_tts_voice(TTSConfig())
    audio, said = caller_audio(voice, [{"say": "What is the capital", "then": 0.5},
                                       {"say": "of Spain?", "then": 2.0}])
    [(start, end)] = said
    runs = voiced_runs(audio, 16000)
    assert abs(start - runs[0][0]) < 0.02 and abs(end - runs[-1][1]) < 0.02
