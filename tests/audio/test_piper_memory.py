"""Piper's memory does not grow with the phrases it speaks (audio.loaders.load_piper).

onnxruntime's CPU arena kept the largest buffers it had seen and grew by doubling: in a server
that speaks phrases of every length it held +550 MB after a few calls."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

from audio.loaders import load_piper
from audio.synth import synthesize
from voiceagent.bench.serve import rss_mb
from voiceagent.models import resolve

LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
PHRASES = [
    "Hi.",
    "The capital of France is Paris.",
    "Once upon a time, a brave little dragon lived in a cave high in the misty mountains, "
    "and every morning he flew over the valley to watch the villagers at work in the fields.",
    "Sure, I can help with that.",
]
MAX_GROWTH_MB = 60  # with the arena: +190 MB on these phrases


def _settled_rss() -> float:
    gc.collect()
    LIBC.malloc_trim(0)
    return rss_mb()


def test_speaking_phrases_of_every_length_does_not_grow_memory():
    voice = load_piper(resolve("piper-joe-medium", "tts").location)
    synthesize(voice, PHRASES[0])  # one-off allocations of the first run
    before = _settled_rss()
    for _ in range(2):
        for phrase in PHRASES:
            synthesize(voice, phrase)
    grown = _settled_rss() - before
    print(f"Piper: RSS {before:.0f} MB, +{grown:.0f} MB after {2 * len(PHRASES)} phrases")
    assert grown < MAX_GROWTH_MB
