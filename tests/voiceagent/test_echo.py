"""The echo rule of `voiceagent.bench.echo` on hand-made caller/reply pairs."""

from __future__ import annotations

import pytest

from voiceagent.bench.echo import echoes, load_echo_set, variant_config, words
from voiceagent.config import PROMPTS_DIR, load_config

ECHOES = [
    # The walkthrough's two replies.
    ("The time does the pharmacy open on Saturday.",
     "The time does the pharmacy open on Saturday."),
    ("I am a helmet western.", "I'm a helmet western."),
    ("I am a helmet western.", "I'm a helmet western. How can I help you?"),
    ("Hello.", "Hello!"),
    ("My order did not arrive.", "My order didn't arrive."),
    ("Can you book a table for four people?", "Yes, can you book a table for four people."),
]
ANSWERS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Hello.", "Hello! How can I help you today?"),
    ("The time does the pharmacy open on Saturday.", "Sorry, could you say that again?"),
    ("I am a helmet western.", "I'm sorry, I didn't catch that."),
    ("Okay.", "Is there anything else I can help with?"),
    ("My internet has been down since this morning.",
     "I'm sorry to hear that. Have you tried restarting your router?"),
]


def test_words_expand_contractions_and_drop_punctuation():
    assert words("I'm here, aren't you? Don't!") == ["i", "am", "here", "are", "not", "you", "do",
                                                     "not"]


@pytest.mark.parametrize(("caller", "reply"), ECHOES)
def test_a_repeat_of_the_callers_words_is_an_echo(caller, reply):
    assert echoes(caller, reply)


@pytest.mark.parametrize(("caller", "reply"), ANSWERS)
def test_an_answer_is_not_an_echo(caller, reply):
    assert not echoes(caller, reply)


def test_the_echo_set_loads_and_its_variants_validate():
    utterances, variants = load_echo_set(PROMPTS_DIR / "echo_v1.yaml")
    assert len(utterances) >= 30
    assert ("misheard", "I am a helmet western.") in utterances
    cfg = load_config(None)
    for overrides in variants.values():
        assert variant_config(cfg, overrides or {}).engine.sampling.temperature == 0.0


def test_a_variant_may_not_change_the_loaded_engine():
    with pytest.raises(ValueError, match="only set"):
        variant_config(load_config(None), {"engine": {"speculation": {"method": "off"}}})
