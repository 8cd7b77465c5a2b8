"""Our own CPU kernels, built where they can be: the weight-only 4- and 8-bit products
(int_kernel.cpp) and a decoder layer's small steps (layer_ops.cpp: RMSNorm, SiLU times up, a
short forward's attention), one library, used together or not at all.

torch's int4 CPU kernel multiplies every weight of every row in fp32, so the rows of a shared
forward cost nearly what separate forwards do. This one quantises each activation row per group
of 32 to two int8 codes, x ~ dx (q + r / 128), and takes each group's dot products with
AVX512-VNNI's vpdpbusd, four products a lane, then applies the per-group scales (fp16, as a
GGUF stores them) in fp32. With the remainder r the activations keep about 14 bits (bf16 keeps
8); int8 alone (llama.cpp's q8_1) dropped the embedded target's top-1 agreement with fp32 from
0.967 (torch's kernel) to 0.954, and with r it is 0.994 (Intel Xeon, 2026-12-06). A row's
outputs do not depend on the other rows (each runs the same instructions), so the engine's
bit-identity holds.

It is compiled with torch's C++ extension builder by `python -m llm_engine.lean.int_kernel`
(scripts/setup.sh runs it), or on first use, into `build_dir()`: VOICEAGENT_KERNEL_DIR, else the
environment's share/voiceagent/kernels, one folder per source, torch version and flags; a service
user who cannot write there loads what set-up built. Where it cannot be built or the CPU lacks
AVX512-VNNI, `available` says why once and the lean layers keep torch's kernels and ops.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

GROUP = 32
LANES = 16  # outputs a block: one AVX512 register of int32 sums
# the products, and a decoder layer's small steps (norm, SiLU, attention: `layer_ops.cpp`)
SOURCES = tuple(Path(__file__).with_name(name) for name in ("int_kernel.cpp", "layer_ops.cpp"))
HEADER = Path(__file__).with_name("avx512.h")  # their shared loads and stores


_wanted = True


def use(wanted: bool) -> None:
    """Whether layers built from now on take the kernel where it runs (`engine.int_kernel`)."""
    global _wanted
    _wanted = wanted


def wanted() -> bool:
    """What `use` last asked for."""
    return _wanted


def enabled() -> bool:
    """Whether layers built now run on the kernel: wanted, built, and this CPU runs it."""
    return _wanted and available()


def name() -> str:
    """What runs the lean layers built now, for the keys of cached measurements."""
    return f"own-{_digest()}" if enabled() else "torch"


@cache
def available() -> bool:
    """Whether the kernels are built and this CPU runs them (built on the first call)."""
    reason = _load()
    if reason:  # a CPU without the instructions is expected; a failed build is not
        level = logging.WARNING if "built" in reason else logging.INFO
        log.log(level, "our own CPU kernels not used: %s; the lean layers run on torch's "
                "kernels and ops", reason)
    return not reason


def build_dir() -> Path:
    """Where this source, torch and flags' build lives: VOICEAGENT_KERNEL_DIR, else the
    environment's share/voiceagent/kernels (set-up builds it there, the service loads it)."""
    root = os.environ.get("VOICEAGENT_KERNEL_DIR") or Path(sys.prefix) / "share/voiceagent/kernels"
    return Path(root) / _digest()


@cache
def _digest() -> str:
    """The build's identity: the sources, torch's version and the compiler flags."""
    text = b"".join(source.read_bytes() for source in (*SOURCES, HEADER)) + \
        f"|{torch.__version__}|{' '.join(_FLAGS)}".encode()
    return hashlib.sha256(text).hexdigest()[:16]


# No contraction of a product and a sum into one FMA: the layer ops round as torch's separate ops.
_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")


def _load() -> str:
    """An empty string when loaded and runnable, else why not."""
    capability = torch.backends.cpu.get_cpu_capability()
    if not sys.platform.startswith("linux") or not capability.startswith("AVX512"):
        return f"it needs Linux on an AVX512 CPU (torch sees {capability})"
    try:
        _load_or_build(build_dir())
    except Exception as err:  # noqa: BLE001 - any failure to build or load means torch's kernels
        last = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
        return f"it could not be built or loaded in {build_dir()} ({last})"
    if not torch.ops.voiceagent_int.supported():
        return "this CPU lacks AVX512-VNNI"
    return ""


def _load_or_build(folder: Path) -> None:
    """Load the library, building it first where it is missing or unreadable. One process at a
    time, under a lock the OS drops when its holder dies (torch's own build lock would leave a
    file behind that every later build waits on forever)."""
    library = folder / "voiceagent_int.so"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = (folder / "build.lock").open("a")
    except OSError:  # an install this user cannot write to: what set-up built, or nothing
        torch.ops.load_library(str(library))
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            torch.ops.load_library(str(library))
            return
        except OSError:  # not built yet, or left half-written by a build that died
            pass
        (folder / "lock").unlink(missing_ok=True)  # torch's, from a build that died
        library.unlink(missing_ok=True)
        _build(folder)


def _build(folder: Path) -> None:
    from torch.utils import cpp_extension

    venv_bin = Path(sys.executable).parent  # pip's ninja, where the shell's PATH lacks one
    if shutil.which("ninja") is None and (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    log.info("building our own kernels in %s (seconds, once)", folder)
    cpp_extension.load(name="voiceagent_int", sources=[str(s) for s in SOURCES],
                       is_python_module=False, build_directory=str(folder),
                       extra_cflags=list(_FLAGS), extra_ldflags=["-fopenmp"])


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [out, in] (0..15 for bits 4, 0..255 for 8) in the kernel's layout: blocks of
    16 outputs, per block and group 8 chunks of [16 outputs][4 inputs]; 4-bit codes two chunks a
    byte, chunk 2p in the low nibble and 2p + 1 in the high."""
    out_features, in_features = codes.shape
    blocks, groups = -(-out_features // LANES), in_features // GROUP
    padded = torch.zeros(blocks * LANES, in_features, dtype=torch.uint8)
    padded[:out_features] = codes.to(torch.uint8).cpu()
    # (block, lane, group, chunk, input) -> (block, group, chunk, lane, input)
    chunks = padded.reshape(blocks, LANES, groups, 8, 4).permute(0, 2, 3, 1, 4)
    if bits == 8:
        return chunks.contiguous().reshape(-1)
    return (chunks[:, :, 0::2] | chunks[:, :, 1::2] << 4).contiguous().reshape(-1)


def pack_scales(values: torch.Tensor) -> torch.Tensor:
    """Per-group floats [out, groups] as [block, group, 16 outputs] float16 (a GGUF's scales
    and minima are fp16: exact)."""
    out_features, groups = values.shape
    blocks = -(-out_features // LANES)
    padded = torch.zeros(blocks * LANES, groups, dtype=torch.float16)
    padded[:out_features] = values.cpu()
    return padded.reshape(blocks, LANES, groups).permute(0, 2, 1).contiguous()


def fits(*values: torch.Tensor) -> bool:
    """Whether per-group scales keep their value in fp16 to 2^-10 (a GGUF's are fp16 already;
    ones quantised here may fall out of its range or into its subnormals)."""
    for v in values:
        v = v.float()
        half = v.half().float()
        if not (half.isfinite().all() and ((half - v).abs() <= v.abs() * 2.0 ** -10).all()):
            return False
    return True


class Packed:
    """One weight, w = d * u + m per group of GROUP inputs, in the kernel's layout (d and m in
    fp16: `fits` says whether they can be)."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None):
        """codes [out, in] unsigned; d, m [out, in / GROUP]; bias [out] or None."""
        if bits not in (4, 8):
            raise ValueError(f"the int kernel runs 4- or 8-bit codes, not {bits}")
        self.out_features, self.bits = codes.shape[0], bits
        self.codes = pack(codes, bits)
        self.d, self.m = pack_scales(d), pack_scales(m)
        self.bias = None if bias is None else bias.float().contiguous()
        self._op = torch.ops.voiceagent_int.mm.default

    def mm(self, x: torch.Tensor, out_float: bool = False) -> torch.Tensor:
        """x [..., in] (float32 or bfloat16) times the weight: [..., out] in x's dtype, or
        float32 with out_float."""
        if x.dim() == 2 and x.is_contiguous():  # the forward's rows: no reshapes on the hot path
            return self._op(x, self.codes, self.d, self.m, self.bias, self.out_features,
                            self.bits, out_float)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = self._op(rows, self.codes, self.d, self.m, self.bias, self.out_features, self.bits,
                       out_float)
        return out.reshape(*x.shape[:-1], self.out_features)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The codes [out, in] (uint8), d and m [out, in / GROUP] read back from the layout."""
        blocks, groups = self.d.shape[:2]
        chunks = self.codes.reshape(blocks, groups, -1, LANES, 4)
        if self.bits == 4:  # chunk 2p low nibble, 2p + 1 high
            chunks = torch.stack([chunks & 15, chunks >> 4], dim=3).reshape(
                blocks, groups, 8, LANES, 4)
        codes = chunks.permute(0, 3, 1, 2, 4).reshape(blocks * LANES, groups * GROUP)
        d, m = (t.permute(0, 2, 1).reshape(blocks * LANES, groups).float()
                for t in (self.d, self.m))
        n = self.out_features
        return codes[:n], d[:n], m[:n]

    def dequantised(self) -> torch.Tensor:
        """The weights [out, in] as the kernel reads them from its layout, in float32."""
        codes, d, m = self.unpacked()
        q = codes.float().reshape(*d.shape, GROUP)
        return (q * d[..., None] + m[..., None]).reshape(codes.shape)


def main() -> int:
    """Build the kernel now (set-up calls this so that no call waits on the compiler)."""
    reason = _load()
    print(f"[setup] our own CPU kernels: {reason or 'built, and this CPU runs them'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
