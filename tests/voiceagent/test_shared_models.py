"""The process-wide models a call's pipeline is built over."""


import re
import time

import pytest

from tests.voiceagent.serving import server_config
from tests.voiceagent.tiny_shared import tiny_shared
from voiceagent.pipeline.builder import build_call
from voiceagent.pipeline.speech_models import SpeechModels, _synthesising


def test_a_call_over_shared_models_without_speech_models_is_refused_by_name(tmp_path):
    shared = tiny_shared()  # an LLM only, as a process serving the HTTP API alone has
    try:
        with pytest.raises(ValueError, match="no speech models"):
            build_call(server_config(tmp_path), shared, transport=None, on_turn=print)
    finally:
        shared.close()


@pytest.mark.parametrize("override,why", [
    ("tts.cpu_threads=1", "loaded for other settings: tts.cpu_threads=1 (loaded: 0)"),
    ("turn.stop=smart_turn", "no Smart Turn model is loaded"),
])
def test_a_call_whose_config_needs_other_speech_models_is_refused_by_name(
        tmp_path, override, why):
    shared = tiny_shared()
    shared.speech = SpeechModels.load(server_config(tmp_path), lambda _: None)
    try:
        with pytest.raises(ValueError, match=re.escape(why)):
            build_call(server_config(tmp_path, override), shared, transport=None, on_turn=print)
    finally:
        shared.close()


def test_a_tts_that_fails_while_the_engine_measures_beside_it_fails_the_measurement():
    class BrokenVoice:
        def synthesize(self, text):
            raise OSError("no espeak-ng data")

    with pytest.raises(RuntimeError, match="no espeak-ng data"):
        with _synthesising(BrokenVoice()):
            time.sleep(0.05)
