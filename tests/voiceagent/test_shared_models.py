"""The process-wide models a call's pipeline is built over."""

import pytest

from tests.voiceagent.serving import server_config
from tests.voiceagent.tiny_shared import tiny_shared
from voiceagent.pipeline.builder import build_call


def test_a_call_over_shared_models_without_speech_models_is_refused_by_name(tmp_path):
    shared = tiny_shared()  # an LLM only, as a process serving the HTTP API alone has
    try:
        with pytest.raises(ValueError, match="no speech models"):
            build_call(server_config(tmp_path), shared, transport=None, on_turn=print)
    finally:
        shared.close()
