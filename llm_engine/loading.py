"""Load a causal LM and its tokenizer from a local HF folder, a GGUF file, or a hub id (its
cached snapshot when the hub cannot be reached: `llm_engine.hub`).

Device and dtype are automatic (CUDA+bf16, MPS+fp16, else CPU+fp32) unless configured.
GGUF files are de-quantised by transformers' GGUF loader, which is slow (about 30 s for a
135M model on 2 CPU cores), so the de-quantised weights are cached as safetensors in
`<cache_dir>/gguf/<sha256 prefix>/` and later loads read that folder instead.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils.logging import tqdm as hf_tqdm

from llm_engine.errors import ModelLoadError
from llm_engine.file_hash import file_sha256
from llm_engine.hub import HubUnavailable, hub_location

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    name: str  # as configured, e.g. "smollm2-135m-instruct" or a path
    source: str  # resolved folder/file path or hub id
    gguf_file: str | None
    revision: str | None  # hub commit, when loaded from a hub
    file_sha256: str | None  # hash of the weights file, for a local GGUF
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: str
    dtype: str
    param_bytes: int  # parameters + buffers, tied weights counted once
    load_s: float
    from_cache: bool


def pick_device(device: str = "auto") -> torch.device:
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def model_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def _sha256_bar(path: Path):
    """A bar (on a terminal, after 2 s) with transformers' loading bars: off where they are off."""
    return lambda total: hf_tqdm(total=total, unit="B", unit_scale=True, desc=f"sha256 {path.name}",
                                 leave=False, delay=2, disable=None)


def _is_pathlike(source: str) -> bool:
    return source.startswith(("/", ".", "~")) or source.endswith(".gguf") or os.path.exists(source)


def _locate(source: str) -> tuple[Path | None, str | None]:
    """(folder, gguf file name) for a local source, or (None, None) for a hub id."""
    if not _is_pathlike(source):
        return None, None
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a GGUF file or a folder")
        return path.parent, path.name
    if (path / "config.json").exists():
        return path, None
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return path, ggufs[0]
    raise ModelLoadError(
        f"{path} has no config.json and {len(ggufs)} .gguf files; pass the model file itself"
    )


def load_causal_lm(
    source: str,
    *,
    name: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    cache_dir: str | Path | None = None,
    progress=print,
) -> LoadedModel:
    """Load model + tokenizer; `progress` receives one-line status messages."""
    t0 = time.perf_counter()
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    folder, gguf = _locate(source)
    cache = Path(cache_dir).expanduser() if cache_dir else None
    sha, from_cache, revision = None, False, None
    if folder is None:  # a hub id: without a network, its cached snapshot or an error at once
        try:
            located = hub_location(source)
        except HubUnavailable as exc:
            raise ModelLoadError(str(exc)) from None
        if located != source:
            folder, revision = Path(located), Path(located).name  # snapshots/<commit>
    # Straight onto the GPU: an 8B model never passes through host memory as a whole.
    placement = {"device_map": str(dev)} if dev.type == "cuda" else {}
    try:
        if gguf is not None:
            sha = file_sha256(folder / gguf, cache, _sha256_bar(folder / gguf))
            load_dir, from_cache = _dequantised_folder(folder, gguf, sha, cache, progress)
            tokenizer = AutoTokenizer.from_pretrained(load_dir)
            model = AutoModelForCausalLM.from_pretrained(load_dir, dtype=torch_dtype, **placement)
        else:
            where = str(folder) if folder else source
            progress(f"loading {where} ({torch_dtype}, {dev})")
            tokenizer = AutoTokenizer.from_pretrained(where)
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, **placement)
            if folder is None:
                revision = getattr(model.config, "_commit_hash", None)
    except ModelLoadError:
        raise
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(_short_reason(source, exc)) from exc
    model.to(dev).eval()
    return LoadedModel(
        name=name or source,
        source=str(folder / gguf) if gguf else str(folder or source),
        gguf_file=gguf,
        revision=revision,
        file_sha256=sha,
        model=model,
        tokenizer=tokenizer,
        device=str(dev),
        dtype=str(torch_dtype).removeprefix("torch."),
        param_bytes=model_bytes(model),
        load_s=time.perf_counter() - t0,
        from_cache=from_cache,
    )


def servable_folder(source: str, cache_dir: str | Path, progress=print) -> str:
    """A folder other servers (vLLM, SGLang) can load: its own, or a GGUF's de-quantised copy."""
    folder, gguf = _locate(source)
    if gguf is None:
        return str(folder or source)
    cache = Path(cache_dir).expanduser()
    sha = file_sha256(folder / gguf, cache, _sha256_bar(folder / gguf))
    return str(_dequantised_folder(folder, gguf, sha, cache, progress)[0])


def _dequantised_folder(
    folder: Path, gguf: str, sha: str, cache: Path | None, progress
) -> tuple[Path, bool]:
    """Folder with the de-quantised safetensors, made once per GGUF file hash."""
    if cache is None:
        raise ModelLoadError("GGUF models need a cache_dir for their de-quantised weights")
    target = cache / "gguf" / sha[:16]
    if (target / "config.json").exists():
        progress(f"loading cached de-quantised weights of {gguf} from {target}")
        return target, True
    progress(f"de-quantising {gguf} (first run only; cached in {target})")
    _gguf_bar_obeys_transformers()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    # The weights are plain tensors now; drop the GGUF marker that blocks save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # A folder of this process's own: several processes may de-quantise the same file at once
    # (test workers, a rolling restart on a fresh machine); the first rename wins.
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(target)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{target.name}.{os.getpid()}.",
                                    suffix=".partial"))
    partial.chmod(0o755)  # as a plain mkdir makes it: a cache other accounts may read
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / "SOURCE.json").write_text(json.dumps({"gguf": str(folder / gguf),
                                                         "sha256": sha}))
        partial.rename(target)  # atomic: an interrupted run never leaves a half-written cache
    except OSError:
        if not (target / "config.json").exists():
            raise
        progress(f"another process de-quantised {gguf} first; using {target}")
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target, False


def _remove_abandoned(target: Path) -> None:
    """Partial folders of processes that died de-quantising (killed, out of memory): each is
    a full-size copy, and nothing else would remove it."""
    for partial in target.parent.glob(f"{target.name}.*.partial"):
        pid = partial.name.split(".")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another account's process
    return True


def _gguf_bar_obeys_transformers() -> None:
    """transformers draws its GGUF de-quantisation bar with tqdm.auto's own tqdm, which its
    progress-bar switch does not reach: give that module transformers' tqdm, so the bar is off
    where transformers' bars are (off a terminal, under --log-json)."""
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    if getattr(hf_gguf, "tqdm", None) is not None:
        hf_gguf.tqdm = hf_tqdm


def _short_reason(source: str, exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"cannot load '{source}': {text}"
