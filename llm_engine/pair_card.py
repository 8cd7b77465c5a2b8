"""The pair card: one JSON record of a served target/draft pair.

A pair or proposal mechanism gets one record before it is benchmarked, so results name what
produced them: model identities with revision, precision and licence; tokenizer compatibility;
runtime and algorithm; draft length and adaptive policy; sampling; context limits; resident
memory of the pair; and fallback behaviour. Approving a pair and rolling it back (who owns it)
is a human process; `card_hash` is the artefact it can pin: any change to the pair or its
settings changes the hash.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers

from llm_engine.config import SpeculationConfig
from llm_engine.methods import model_settings

ALGORITHM = (
    "speculative decoding: the proposer drafts K tokens, the target verifies them in one pass "
    "by exact match (greedy) or rejection sampling min(1, p/q) with residual resampling "
    "(Leviathan et al. 2023; Chen et al. 2023)"
)


@dataclass
class ModelIdentity:
    name: str
    source: str
    gguf_file: str | None
    revision: str | None
    file_sha256: str | None
    architecture: str  # config.architectures[0], else the model class
    model_type: str | None
    dtype: str
    device: str
    param_bytes: int
    licence: str | None

    @classmethod
    def from_loaded(cls, loaded) -> ModelIdentity:
        config = loaded.model.config
        archs = getattr(config, "architectures", None) or [type(loaded.model).__name__]
        return cls(
            name=loaded.name,
            source=loaded.source,
            gguf_file=loaded.gguf_file,
            revision=loaded.revision,
            file_sha256=loaded.file_sha256,
            architecture=archs[0],
            model_type=getattr(config, "model_type", None),
            dtype=loaded.dtype,
            device=loaded.device,
            param_bytes=int(loaded.param_bytes),
            licence=find_licence(loaded),
        )


@dataclass
class PairCard:
    target: ModelIdentity
    draft: ModelIdentity | None
    proposer: dict
    sampling: dict
    max_context: int
    resident_bytes: int
    runtime: dict
    fallback: str
    compatibility: dict
    created_at: str
    card_hash: str = field(default="")

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True, ensure_ascii=False)

    def compute_hash(self) -> str:
        """sha256 of the canonical JSON without created_at and card_hash: stable per pair."""
        body = {k: v for k, v in self.to_dict().items() if k not in ("created_at", "card_hash")}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: dict) -> PairCard:
        """Rebuild a card; refuses one whose content no longer matches its hash."""
        data = dict(data)
        data["target"] = ModelIdentity(**data["target"])
        data["draft"] = ModelIdentity(**data["draft"]) if data.get("draft") else None
        card = cls(**data)
        if card.card_hash != card.compute_hash():
            raise ValueError("pair card content does not match its card_hash (edited?)")
        return card

    @classmethod
    def from_json(cls, text: str) -> PairCard:
        return cls.from_dict(json.loads(text))


def proposer_record(spec: SpeculationConfig, draft) -> dict:
    """Method, draft length and adaptive policy."""
    if spec.method == "off":
        record: dict = {"method": "off", "draft_tokens": None, "adaptive_policy": None}
    else:
        record = {
            "method": spec.method,
            "draft_tokens": {
                "initial": spec.num_draft_tokens,
                "min": spec.min_draft_tokens,
                "max": spec.max_draft_tokens,
            },
            "adaptive_policy": (
                "K follows the measured acceptance per request, within [min, max]"
                if spec.adaptive
                else "fixed K"
            ),
        }
    if spec.method == "ngram":
        record["ngram_sizes"] = {"min": spec.ngram_min, "max": spec.ngram_max}
    record["gate"] = spec.gate and spec.method != "off"
    record["draft_model"] = _draft_note(spec.method, draft)
    return record


def runtime_record(device: str, method: str, runner: str = "eager") -> dict:
    """Serving runtime, algorithm and hardware; the weights' format is on the model identities."""
    return {
        "engine": "llm_engine (in-process)",
        "runner": runner,
        "algorithm": "plain autoregressive decoding" if method == "off" else ALGORITHM,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
    }


def _draft_note(method: str, draft) -> str:
    if draft is not None:
        used = "used" if method in model_settings() else f"loaded but unused by method {method!r}"
        return f"{draft.name} ({used})"
    if method == "ngram":
        return "none: the ngram proposer drafts by prompt lookup over the prompt and output"
    return "none: method 'off' decodes with the target alone"


def fallback_text(spec: SpeculationConfig) -> str:
    """Fallback behaviour when speculation is disabled or does not pay."""
    lossless = (
        "The output is unchanged either way: every emitted token is chosen by the "
        "target's verification, so speculation changes speed, never text."
    )
    if spec.method == "off":
        return "Speculation is off: plain target decoding through the same code path. " + lossless
    if spec.gate:
        return (
            "Per request, a gate turns speculation off when measured drafting plus "
            "verification costs more than it saves; the request continues with plain "
            "target decoding. " + lossless
        )
    return "No gate: speculation stays on for every request. " + lossless


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # bytes


def _gguf_string_field(path: Path, key: str) -> str | None:
    """One string field of a GGUF file's metadata (spec: ggml/docs/gguf.md), or None."""

    def read_str(f) -> str:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode("utf-8", "replace")

    def skip(f, vtype: int, count: int = 1) -> None:
        if vtype in _GGUF_SCALARS:
            f.seek(_GGUF_SCALARS[vtype] * count, 1)
        elif vtype == 8:
            for _ in range(count):
                f.seek(struct.unpack("<Q", f.read(8))[0], 1)
        elif vtype == 9:
            for _ in range(count):
                itype, n = struct.unpack("<IQ", f.read(12))
                skip(f, itype, n)
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")

    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF" or struct.unpack("<I", f.read(4))[0] < 2:
                return None
            _, n_kv = struct.unpack("<QQ", f.read(16))
            for _ in range(n_kv):
                name, vtype = read_str(f), struct.unpack("<I", f.read(4))[0]
                if name == key and vtype == 8:
                    return read_str(f)
                skip(f, vtype)
    except (OSError, ValueError, struct.error):
        return None
    return None


def find_licence(loaded) -> str | None:
    """Licence from the model config, GGUF metadata, or the model card's front matter."""
    for attr in ("license", "licence"):
        if value := getattr(loaded.model.config, attr, None):
            return str(value)
    path = Path(loaded.source)
    if loaded.gguf_file and path.is_file():
        if value := _gguf_string_field(path, "general.license"):
            return value
    readme = (path.parent if path.is_file() else path) / "README.md"
    if readme.is_file():
        lines = readme.read_text(errors="replace").splitlines()
        if lines and lines[0].strip() == "---":
            for line in lines[1:]:
                if line.strip() == "---":
                    break
                if line.startswith("license:"):
                    return line.split(":", 1)[1].strip().strip("'\"") or None
    return None
