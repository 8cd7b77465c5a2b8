"""Piper's memory does not grow with the phrases it speaks (audio.loaders.load_piper).

onnxruntime's CPU arena kept the largest buffers it had seen and grew by doubling: in a server
that speaks phrases of every length it held +550 MB after a few calls."""

from __future__ import annotations

from audio.loaders import load_piper
from audio.synth import synthesize
from tests.memory import settled_memory
from voiceagent.models import resolve

PHRASES = [
    "Hi.",
    "The capital of France is Paris.",
    "Once upon a time, a brave little dragon lived in a cave high in the misty mountains, "
    "and every morning he flew over the valley to watch the villagers at work in the fields.",
    "Sure, I can help with that.",
]
MAX_GROWTH_MB = 60  # with the arena: +190 MB on these phrases


def test_speaking_phrases_of_every_length_does_not_grow_memory():
    voice = load_piper(resolve("piper-joe-medium", "tts").location)
    synthesize(voice, PHRASES[0])  # one-off allocations of the first run
    before, _ = settled_memory()
    for _ in range(2):
        for phrase in PHRASES:
            synthesize(voice, phrase)
    grown = settled_memory()[0] - before
    print(f"Piper: RSS {before:.0f} MB, +{grown:.0f} MB after {2 * len(PHRASES)} phrases")
    assert grown < MAX_GROWTH_MB
