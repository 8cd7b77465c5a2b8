"""Our own AVX512-VNNI kernel for q4 and q8 layers (`llm_engine.lean.int_kernel`)."""

from __future__ import annotations

import pytest
import torch

from llm_engine.lean import int_kernel, linear
from tests.llm_engine.int_rows import quantised_rows

pytestmark = pytest.mark.skipif(not int_kernel.available(),
                                reason="our own int kernel does not run here (no AVX512-VNNI)")


def weight(out_features: int, in_features: int, bits: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (out_features, in_features), generator=generator,
                          dtype=torch.uint8)
    d = 0.001 + torch.rand(out_features, in_features // 32, generator=generator) * 0.01
    m = -d * 2 ** (bits - 1) + torch.randn(d.shape, generator=generator) * 0.001
    return codes, d.half().float(), m.half().float()  # as a GGUF stores them


def dequantised(codes, d, m):
    w = codes.double().reshape(*d.shape, 32) * d.double()[..., None] + m.double()[..., None]
    return w.reshape(codes.shape)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [16, 40, 200])  # whole blocks of 16 and a part block
def test_the_product_is_the_weights_times_the_rows_quantised_per_group(bits, dtype, out_features):
    codes, d, m = weight(out_features, 96, bits)
    bias = torch.randn(out_features)
    packed = int_kernel.Packed(codes, d, m, bits, bias)
    x = torch.randn(5, 96).to(dtype)
    want = quantised_rows(x) @ dequantised(codes, d, m).t() + bias.double()
    got = packed.mm(x, out_float=True)
    assert got.dtype == torch.float32 and got.shape == (5, out_features)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_outputs_are_bit_identical_whatever_rows_share_the_product(bits, dtype):
    codes, d, m = weight(200, 128, bits)
    packed = int_kernel.Packed(codes, d, m, bits)
    x = torch.randn(12, 128).to(dtype)
    together = packed.mm(x)
    for rows in (1, 2, 3, 4, 5, 11):
        assert torch.equal(packed.mm(x[:rows]), together[:rows]), rows
    alone = torch.cat([packed.mm(x[i : i + 1]) for i in range(12)])
    assert torch.equal(alone, together)


def test_the_outputs_do_not_depend_on_the_thread_count():
    codes, d, m = weight(4096, 576, 4)
    packed = int_kernel.Packed(codes, d, m, 4)
    x = torch.randn(3, 576).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed.mm(x)
        torch.set_num_threads(2)
        two = packed.mm(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bfloat16_outputs_round_to_nearest_even_as_torch_does():
    codes, d, m = weight(64, 64, 4)
    packed = int_kernel.Packed(codes, d, m, 4)
    x = torch.randn(4, 64).bfloat16()
    assert torch.equal(packed.mm(x), packed.mm(x, out_float=True).to(torch.bfloat16))


def test_a_zero_row_gives_the_bias_alone():
    codes, d, m = weight(32, 64, 8)
    bias = torch.randn(32)
    packed = int_kernel.Packed(codes, d, m, 8, bias)
    assert torch.equal(packed.mm(torch.zeros(1, 64), out_float=True)[0], bias)


def test_leading_dimensions_are_kept():
    codes, d, m = weight(32, 64, 4)
    packed = int_kernel.Packed(codes, d, m, 4)
    x = torch.randn(2, 3, 64)
    assert torch.equal(packed.mm(x), packed.mm(x.reshape(6, 64)).reshape(2, 3, 32))


def test_a_mismatched_input_is_refused_with_the_reason():
    codes, d, m = weight(32, 64, 4)
    packed = int_kernel.Packed(codes, d, m, 4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        packed.mm(torch.randn(2, 48))
    with pytest.raises(RuntimeError, match="codes do not match"):
        packed.mm(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        packed.mm(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="4- or 8-bit"):
        int_kernel.Packed(codes, d, m, 2)


def test_q4_layers_take_our_kernel_unless_torchs_is_asked_for():
    codes, d, m = weight(32, 64, 4)
    assert linear.Int4Linear(codes, d, m, torch.bfloat16).own is not None
    int_kernel.use(False)
    try:
        layer = linear.Int4Linear(codes, d, m, torch.bfloat16)
        assert layer.own is None and int_kernel.name() == "torch"
    finally:
        int_kernel.use(True)
    assert int_kernel.name().startswith("own-")


def test_fused_layers_keep_each_ones_weights(int_kernel_choice):
    parts = [weight(32, 64, 4, seed) for seed in (1, 2)]
    layers = [linear.Int4Linear(c, d, m, torch.bfloat16, torch.randn(32)) for c, d, m in parts]
    fused = linear.concat(layers)
    assert torch.equal(fused.dequantised(), torch.cat([layer.dequantised() for layer in layers]))
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(fused(x), torch.cat([layer(x) for layer in layers], dim=-1))


def test_the_largest_codes_and_activations_do_not_overflow():
    # every code at its top, every activation at its group's maximum or at a half-way remainder
    for bits in (4, 8):
        codes = torch.full((16, 32 * 64), 2 ** bits - 1, dtype=torch.uint8)
        d = torch.full((16, 64), 1.0)
        m = torch.zeros(16, 64)
        packed = int_kernel.Packed(codes, d, m, bits)
        x = torch.full((2, 32 * 64), 127.0)
        x[1, 1::2] = 127.0 * (3.5 + 0.5 / 128) / 127  # x / dx = 3.5 + 1/256: r rounds to 64
        want = quantised_rows(x) @ dequantised(codes, d, m).t()
        torch.testing.assert_close(packed.mm(x, out_float=True).double(), want, rtol=1e-6, atol=0)


def test_no_rows_give_no_outputs():
    codes, d, m = weight(32, 64, 4)
    out = int_kernel.Packed(codes, d, m, 4).mm(torch.zeros(0, 64))
    assert out.shape == (0, 32)


def test_a_nan_activation_gives_nan_outputs_not_numbers():
    codes, d, m = weight(32, 64, 4)
    x = torch.randn(2, 64)
    x[1, 5] = float("nan")
    out = int_kernel.Packed(codes, d, m, 4).mm(x, out_float=True)
    assert out[0].isfinite().all() and out[1].isnan().all()


def test_the_layout_reads_back_as_the_weights():
    for bits in (4, 8):
        codes, d, m = weight(40, 96, bits)
        packed = int_kernel.Packed(codes, d, m, bits)
        want = codes.float().reshape(40, 3, 32) * d[..., None] + m[..., None]  # as fp32 rounds
        assert torch.equal(packed.dequantised(), want.reshape(40, 96))


def test_scales_that_fp16_would_change_keep_torchs_kernel():
    codes, d, m = weight(32, 64, 4)
    assert int_kernel.fits(d, m)
    assert not int_kernel.fits(d * 1e-4, m)  # fp16 subnormals: their digits would go
    assert not int_kernel.fits(d, m * 1e6)  # past fp16's range
    assert linear.Int4Linear(codes, d * 1e-4, m, torch.bfloat16).own is None
    assert linear.Int4Linear(codes, d, m, torch.bfloat16).own is not None
