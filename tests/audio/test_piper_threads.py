"""Piper's onnxruntime threads sleep between ops unless `tts.spin` asks them to spin
(audio.loaders.load_piper): spinning takes cycles from the engine and Whisper on shared cores."""

import pytest

from audio.loaders import load_piper
from voiceagent.models import resolve


@pytest.mark.parametrize("spin,entry", [(False, "0"), (True, "1")])
def test_piper_threads_spin_only_when_asked(spin, entry):
    voice = load_piper(resolve("piper-joe-medium", "tts").location, cpu_threads=2, spin=spin)
    options = voice.session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == entry
