import pytest


@pytest.fixture(scope="session")
def whisper():
    """The embedded faster-whisper tiny.en, loaded once."""
    from audio.loaders import load_whisper
    from voiceagent.models import resolve

    return load_whisper(resolve("whisper-tiny.en", "asr").location)
