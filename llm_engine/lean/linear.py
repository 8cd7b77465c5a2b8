"""Linear layers in the lean forward's weight formats, each one torch kernel.

- dense (float32, bfloat16, float16): `F.linear`.
- int8: weight-only, one scale per output channel, activations in bf16 (or the GPU's half type):
  `aten._weight_int8pack_mm`.
- q4: weight-only 4-bit in groups of 32 along the input, w = d * q + m (a GGUF's Q4_1 blocks,
  codes unchanged, `llm_engine.lean.gguf`).
- q8 in groups of 32 (a GGUF's Q8_0 head, w = d * q).
q4 and q8 run on our own AVX512-VNNI kernel where it is built and the CPU has it
(`llm_engine.lean.int_kernel`): each activation row as two int8 codes per group, integer dot
products, an extra row's cost a fraction of torch's. Elsewhere torch's: q4 on
`aten._weight_int4pack_mm_for_cpu` (CPU) or `aten._weight_int4pack_mm` (CUDA, gpt-fast's int4
path) as w = (q - 8) * scale + zero, scale = d and zero = m + 8d; q8 on the same int4 kernel over
the codes' two nibbles, q = 16 hi + lo, as one product of twice the outputs whose halves are
summed (on a Zen 4 EPYC, SmolLM2's 49152 x 576 head: 3.2 ms a row against 4.3 for the int8
kernel; docs/BENCHMARKS.md, "The q4 head from the file's Q8_0 codes").

torch's kernels take activations in bf16: with fp32 activations both CPU kernels are 10-20x
slower.
"""

from __future__ import annotations

import torch
from torch import nn

from llm_engine.lean import int_kernel

GROUP = 32  # the q4 group: Q4_1's block


def available(fmt: str, device: torch.device) -> bool:
    """Whether this torch has the kernel a weight-only format needs on the device."""
    ops = torch.ops.aten
    if fmt == "q4":
        return hasattr(ops, "_weight_int4pack_mm" if device.type == "cuda"
                       else "_weight_int4pack_mm_for_cpu")
    return fmt != "int8" or hasattr(ops, "_weight_int8pack_mm")


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight  # [out, in]
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """Per-output-channel symmetric int8 weights."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.codes = codes  # [out, in] int8
        self.scales = scales  # [out] in the activation dtype
        self.bias = bias

    @classmethod
    def quantise(cls, weight: torch.Tensor, dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> Int8Linear:
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        codes = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)
        return cls(codes, scales.to(dtype), None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)
        return out if self.bias is None else out + self.bias

    def dequantised(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]


class Int4Linear(nn.Module):
    """4-bit codes in groups of GROUP inputs, w = scale * q + min (a GGUF's Q4_1): our own kernel
    where it runs (`int_kernel`), else the device's torch int4 kernel."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 dtype: torch.dtype, bias: torch.Tensor | None = None):
        """codes [out, in] integers 0..15; scales, mins [out, in / GROUP]."""
        super().__init__()
        out_features, in_features = codes.shape
        if in_features % GROUP or out_features % 8:
            raise ValueError(f"a q4 weight needs inputs in groups of {GROUP} and outputs in "
                             f"eights; got {out_features} x {in_features}")
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        self.bias = None if bias is None else bias.to(dtype)
        codes = codes.to(torch.uint8)
        self.own = _own(codes, scales.float(), mins.float(), 4, self.bias)
        if self.own is None:
            # torch's kernels: w = (q - 8) * scale + zero, [in / GROUP, out, 2] in the activations'
            # dtype; the codes kept unpacked (what the tests compare with the file, `concat`)
            self._codes = codes
            zeros = mins.float() + 8 * scales.float()
            self.scales_zeros = torch.stack([scales.float().t(), zeros.t()], dim=-1).to(dtype) \
                .contiguous()
            self.packed = _pack(codes)

    @property
    def codes(self) -> torch.Tensor:
        """The 4-bit codes [out, in] (read back from our kernel's layout where it runs)."""
        return self.own.unpacked()[0] if self.own is not None else self._codes

    def scales_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's scale and minimum [out, in / GROUP], float32, as the kernel has them."""
        if self.own is not None:
            return self.own.unpacked()[1:]
        sz = self.scales_zeros.float()  # [groups, out, 2]
        scales = sz[..., 0].t()
        return scales, sz[..., 1].t() - 8 * scales

    @classmethod
    def quantise(cls, weight: torch.Tensor, dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> Int4Linear:
        """Asymmetric min/max per group, for weights that did not come as 4-bit codes."""
        w = weight.float().reshape(weight.shape[0], -1, GROUP)
        low, high = w.amin(-1), w.amax(-1)
        scales = ((high - low) / 15.0).clamp(min=1e-12)
        codes = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15)
        return cls(codes.reshape(weight.shape), scales, low, dtype, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own is not None:
            return self.own.mm(x)
        out = _int4_mm(x, self.packed, self.scales_zeros)
        return out if self.bias is None else out + self.bias

    def dequantised(self) -> torch.Tensor:
        """The weights the kernel multiplies by (torch's: the scales rounded to the dtype)."""
        if self.own is not None:
            return self.own.dequantised()
        q = self._codes.float().reshape(self.out_features, -1, GROUP)
        sz = self.scales_zeros.float()  # [groups, out, 2]
        scales, zeros = sz[..., 0].t(), sz[..., 1].t()  # [out, groups]
        return ((q - 8) * scales[..., None] + zeros[..., None]).reshape(q.shape[0], -1)


class Q8Linear(nn.Module):
    """8-bit codes in groups of GROUP inputs with one scale each (w = d * q, q in -128..127).

    Our own kernel runs them where it runs (`int_kernel`: u = q + 128, w = d * u - 128 d). Else
    they run as two 4-bit halves in one product of torch's int4 kernel: hi = floor(q / 16) (code
    hi + 8, scale 16d, zero 8d) and lo = q - 16 hi (code lo, scale d, zero 0). Each half is
    centred (16d (hi + 1/2) and (lo - 8) d), so neither carries an offset the other must cancel
    after both were rounded; they are summed in fp32. The result is fp32 (a head's logits)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 bias: torch.Tensor | None = None):
        """codes [out, in] int8; scales [out, in / GROUP] (the d of each group)."""
        super().__init__()
        out_features, in_features = codes.shape
        if in_features % GROUP or out_features % 4:
            raise ValueError(f"a q8 weight needs inputs in groups of {GROUP} and outputs in "
                             f"fours; got {out_features} x {in_features}")
        self.out_features = out_features
        codes = codes.to(torch.int8)
        self.bias = None if bias is None else bias.float()
        d = scales.float()
        self.own = _own((codes.to(torch.int16) + 128).to(torch.uint8), d, -128 * d, 8, self.bias)
        if self.own is None:
            self._codes = codes  # kept: what the tests compare with the file
            halves = torch.cat([(codes >> 4).to(torch.uint8) + 8,  # >> floors: -8..7 -> 0..15
                                (codes & 15).to(torch.uint8)])
            self.packed = _pack(halves)
            self.scales_zeros = torch.stack([torch.cat([16 * d, d]).t(),
                                             torch.cat([8 * d, torch.zeros_like(d)]).t()],
                                            dim=-1).to(dtype).contiguous()  # [groups, 2 out, 2]

    @property
    def codes(self) -> torch.Tensor:
        """The 8-bit codes [out, in] (read back from our kernel's layout where it runs)."""
        if self.own is None:
            return self._codes
        return (self.own.unpacked()[0].to(torch.int16) - 128).to(torch.int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own is not None:
            return self.own.mm(x, out_float=True)
        both = _int4_mm(x, self.packed, self.scales_zeros)  # [n, 2 out]
        out = both[:, : self.out_features].float() + both[:, self.out_features :].float()
        return out if self.bias is None else out + self.bias

    def dequantised(self) -> torch.Tensor:
        """The weights the kernel multiplies by (torch's: the scales rounded to the dtype)."""
        if self.own is not None:
            return self.own.dequantised()
        q = self._codes.to(torch.int32).reshape(self.out_features, -1, GROUP)
        sz = self.scales_zeros.float()  # [groups, 2 out, 2]
        scales, zeros = sz[..., 0].t(), sz[..., 1].t()  # [2 out, groups]
        codes = torch.cat([(q >> 4) + 8, q & 15]).float()  # [2 out, groups, GROUP]
        w = (codes - 8) * scales[..., None] + zeros[..., None]
        return (w[: self.out_features] + w[self.out_features :]).reshape(self.out_features, -1)


def _own(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
         bias: torch.Tensor | None) -> int_kernel.Packed | None:
    """The weight packed for our own kernel, where it runs on the weight's device; else None."""
    if codes.device.type != "cpu" or not int_kernel.enabled() \
            or not int_kernel.fits(scales, mins):
        return None
    return int_kernel.Packed(codes, scales, mins, bits, bias)


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    if packed.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, scales_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    if codes.device.type == "cuda":  # two codes a byte, high nibble first, in 8 inner k-tiles
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()
        return torch.ops.aten._convert_weight_to_int4pack(pairs, 8)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


def concat(layers: list[nn.Module]) -> nn.Module:
    """One layer computing several side by side (fused QKV, fused gate/up): one kernel call."""
    if len({type(layer) for layer in layers}) != 1:
        raise ValueError("cannot fuse layers of different formats")
    biases = [layer.bias for layer in layers]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise ValueError("cannot fuse layers where only some have a bias")
    bias = None if biases[0] is None else torch.cat(biases)
    first = layers[0]
    if isinstance(first, DenseLinear):
        return DenseLinear(torch.cat([layer.weight for layer in layers]), bias)
    if isinstance(first, Int8Linear):
        return Int8Linear(torch.cat([layer.codes for layer in layers]),
                          torch.cat([layer.scales for layer in layers]), bias)
    scales, mins = zip(*(layer.scales_mins() for layer in layers), strict=True)
    return Int4Linear(torch.cat([layer.codes for layer in layers]), torch.cat(scales),
                      torch.cat(mins), first.dtype, bias)
