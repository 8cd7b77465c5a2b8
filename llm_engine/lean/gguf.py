"""A GGUF file's Q4_1 weights as q4 codes, and its Q8_0 output head as 8-bit codes, unchanged,
under the Hugging Face parameter names.

Q4_1 stores each block of 32 weights as an fp16 scale d, an fp16 minimum m and 16 bytes of 4-bit
codes (element j in the low nibble of byte j, element j + 16 in the high one): w = d * q + m,
as `linear.Int4Linear` takes them.

Q8_0 stores each block of 32 as an fp16 scale d and 32 signed bytes: w = d * q. llama.cpp's
4-bit files keep the output head (or the tied embedding) so: `linear.Q8Linear` runs it.

llama.cpp's converter permutes the rows of the query and key weights for its rotary layout;
transformers' GGUF loader permutes them back, and so does this (rows move whole, so the blocks
and their codes are untouched).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCK = 32
_Q4_1_BYTES = 20  # d (fp16), m (fp16), 16 bytes of codes
_Q8_0_BYTES = 34  # d (fp16), 32 signed bytes of codes
# The output head, or the input embedding that a tied head reads (the converter then writes no
# `output.weight`).
_HEAD_NAMES = {"output.weight": "lm_head.weight", "token_embd.weight": "model.embed_tokens.weight"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class Q4Weight:
    codes: torch.Tensor  # [out, in] uint8, 0..15
    scales: torch.Tensor  # [out, in / 32] float32 (the file's fp16 d)
    mins: torch.Tensor  # [out, in / 32] float32 (the file's fp16 m)

    def dequantised(self) -> torch.Tensor:
        q = self.codes.float().reshape(*self.scales.shape, BLOCK)
        return (q * self.scales[..., None] + self.mins[..., None]).reshape(self.codes.shape)


@dataclass
class Q8Weight:
    codes: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out, in / 32] float32 (the file's fp16 d)

    def dequantised(self) -> torch.Tensor:
        q = self.codes.float().reshape(*self.scales.shape, BLOCK)
        return (q * self.scales[..., None]).reshape(self.codes.shape)


def read_q8_0_head(path: str | Path, name: str) -> Q8Weight | None:
    """The output head ('lm_head.weight') or the input embedding a tied head reads
    ('model.embed_tokens.weight'), where the file stores it as Q8_0; else None."""
    from gguf import GGMLQuantizationType, GGUFReader

    for tensor in GGUFReader(str(path)).tensors:
        if _HEAD_NAMES.get(tensor.name) == name \
                and tensor.tensor_type == GGMLQuantizationType.Q8_0:
            raw = np.asarray(tensor.data)
            blocks = raw.reshape(raw.shape[0], -1, _Q8_0_BYTES)  # [out, in / 32, 34]
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            codes = blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
            return Q8Weight(torch.from_numpy(codes), torch.from_numpy(d))
    return None


def read_q4_1(path: str | Path, num_heads: int, num_kv_heads: int) -> dict[str, Q4Weight]:
    """Every Q4_1 linear weight of a Llama-family GGUF, by its HF name ('...q_proj.weight')."""
    from gguf import GGMLQuantizationType, GGUFReader

    out: dict[str, Q4Weight] = {}
    for tensor in GGUFReader(str(path)).tensors:
        name = _hf_name(tensor.name)
        if name is None or tensor.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        weight = _decode(np.asarray(tensor.data))
        if "q_proj" in name:
            weight = _unpermute(weight, num_heads)
        elif "k_proj" in name:
            weight = _unpermute(weight, num_kv_heads)
        out[name] = weight
    return out


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")  # blk.<i>.<kind>.weight
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"


def _decode(raw: np.ndarray) -> Q4Weight:
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _Q4_1_BYTES)  # [out, in / 32, 20]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:]  # [out, groups, 16]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    return Q4Weight(torch.from_numpy(codes.copy()), torch.from_numpy(d), torch.from_numpy(m))


def _unpermute(weight: Q4Weight, heads: int) -> Q4Weight:
    def rows(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[0] // heads // 2
        return t.reshape(heads, half, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    return Q4Weight(rows(weight.codes), rows(weight.scales), rows(weight.mins))
