"""Our own ops for a decoder layer's small steps (`llm_engine/lean/layer_ops.cpp`): RMSNorm,
SiLU times up, and a short forward's attention with its rotary and cache writes."""

from __future__ import annotations

import pytest
import torch

from llm_engine.lean import int_kernel

pytestmark = pytest.mark.skipif(not int_kernel.available(),
                                reason="our own kernels do not run here (no AVX512-VNNI)")

HEADS, KV_HEADS, DIM, LAYERS, MAX_LEN = 6, 2, 32, 2, 64


def ops():
    return torch.ops.voiceagent_int


@pytest.fixture(params=[True, False], ids=["bf16-dot", "fp32-dot"])
def bf16_dot(request):
    """The scores of bf16 queries and keys by vdpbf16ps where the CPU has it, and without."""
    ops().use_bf16_dot(request.param)
    yield request.param and ops().bf16_dot()
    ops().use_bf16_dot(True)


def torch_rms(x, weight, eps=1e-5):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope(positions, dtype, dim=DIM):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def torch_rotate(x, cos, sin):  # the lean forward's torch path (llama._rotate)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def cache(dtype, max_len=MAX_LEN, dim=DIM):
    return torch.zeros(LAYERS, KV_HEADS, max_len, dim, dtype=dtype), \
        torch.zeros(LAYERS, KV_HEADS, max_len, dim, dtype=dtype)


def attend(qkv, positions, parts, layer=1):
    """parts: [(keys, values, start, count)]."""
    dim = parts[0][0].shape[-1]
    cos, sin = rope(positions, qkv.dtype, dim)
    return ops().attend(qkv, cos, sin, [p[0] for p in parts], [p[1] for p in parts],
                        [p[2] for p in parts], [p[3] for p in parts], layer, HEADS, KV_HEADS,
                        dim ** -0.5)


def reference(qkv, positions, keys, values, layer=1):
    """In float64: each row over its cache's keys up to its position (written by `attend`)."""
    dim = keys.shape[-1]
    cos, sin = rope(positions, qkv.dtype, dim)
    rows = qkv.shape[0]
    q = torch_rotate(qkv[:, :HEADS * dim].view(rows, HEADS, dim), cos, sin).double()
    out = torch.empty(rows, HEADS, dim, dtype=torch.float64)
    for r, pos in enumerate(positions.tolist()):
        for h in range(HEADS):
            k = keys[layer, h // (HEADS // KV_HEADS), :pos + 1].double()
            v = values[layer, h // (HEADS // KV_HEADS), :pos + 1].double()
            out[r, h] = torch.softmax(k @ q[r, h] * dim ** -0.5, dim=0) @ v
    return out.reshape(rows, HEADS * dim)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("scale", [1.0, 1e-3])  # small rows, where eps counts
def test_rms_is_torchs_norm_to_a_rounding(dtype, rtol, scale):
    x, weight = (torch.randn(5, 200) * scale).to(dtype), torch.randn(200).to(dtype)
    got = ops().rms(x, weight, 1e-5)
    assert got.dtype == dtype
    # torch's mean sums in another order: at most one step of the output's rounding apart
    torch.testing.assert_close(got, torch_rms(x, weight), rtol=rtol, atol=1e-6)


def test_rms_and_silu_split_a_prefills_rows_between_threads_without_changing_them():
    x, weight = torch.randn(256, 1536).bfloat16(), torch.randn(1536).bfloat16()
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append((ops().rms(x, weight, 1e-5), ops().silu_mul(x)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    assert torch.equal(outs[0][0][7:8], ops().rms(x[7:8].contiguous(), weight, 1e-5))


def test_rms_gives_a_row_the_same_numbers_alone_or_batched():
    x, weight = torch.randn(7, 576).bfloat16(), torch.randn(576).bfloat16()
    together = ops().rms(x, weight, 1e-5)
    assert torch.equal(torch.cat([ops().rms(x[i:i + 1], weight, 1e-5) for i in range(7)]),
                       together)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_silu_of_the_gate_times_the_up_half(dtype):
    x = (torch.randn(3, 2 * 100) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    got = ops().silu_mul(x)
    assert got.shape == (3, 100) and got.dtype == dtype
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [DIM, 64, 128, 40])  # heads in registers, one in masked chunks
def test_attend_writes_torchs_rotated_keys_and_attends_causally(dtype, cache_dtype, dim, bf16_dot):
    keys, values = cache(cache_dtype, dim=dim)
    rows = 40  # keys in whole blocks of 16 and a part block
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * dim).to(dtype)
    positions = torch.arange(rows)
    got = attend(qkv, positions, [(keys, values, 0, rows)])
    assert got.shape == (rows, HEADS * dim) and got.dtype == dtype
    cos, sin = rope(positions, dtype, dim)
    k = torch_rotate(qkv[:, HEADS * dim:(HEADS + KV_HEADS) * dim].view(rows, KV_HEADS, dim),
                     cos, sin)
    v = qkv[:, (HEADS + KV_HEADS) * dim:].view(rows, KV_HEADS, dim)
    # the keys as the prefill's torch path writes them, bit for bit; other layers untouched
    assert torch.equal(keys[1, :, :rows], k.transpose(0, 1).to(cache_dtype))
    assert torch.equal(values[1, :, :rows], v.transpose(0, 1).to(cache_dtype))
    assert not keys[0].any() and not keys[1, :, rows:].any()
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.double(), reference(qkv, positions, keys, values),
                               rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_attention_is_bit_identical_alone_batched_or_in_a_verify(cache_dtype, bf16_dot):
    qkv = torch.randn(6, (HEADS + 2 * KV_HEADS) * DIM).bfloat16()
    other = torch.randn(3, qkv.shape[1]).bfloat16()
    # a verify: six rows at 20..25 over a cache holding 0..19
    history = torch.randn(LAYERS, KV_HEADS, 20, DIM).to(cache_dtype)
    keys, values = cache(cache_dtype)
    keys[:, :, :20], values[:, :, :20] = history, -history
    verify = attend(qkv, torch.arange(20, 26), [(keys, values, 20, 6)])
    # the same rows one step at a time, each after the rows before it
    keys2, values2 = cache(cache_dtype)
    keys2[:, :, :20], values2[:, :, :20] = history, -history
    steps = torch.cat([attend(qkv[i:i + 1], torch.tensor([20 + i]), [(keys2, values2, 20 + i, 1)])
                       for i in range(6)])
    assert torch.equal(steps, verify)
    # and sharing a forward with another session's rows, before and after it
    keys3, values3 = cache(cache_dtype)
    keys3[:, :, :20], values3[:, :, :20] = history, -history
    other_keys, other_values = cache(cache_dtype)
    shared = attend(torch.cat([other, qkv]), torch.cat([torch.arange(3), torch.arange(20, 26)]),
                    [(other_keys, other_values, 0, 3), (keys3, values3, 20, 6)])
    assert torch.equal(shared[3:], verify)
    assert torch.equal(keys3, keys) and torch.equal(values3, values)


@pytest.mark.parametrize("dim", [DIM, 64, 128])
def test_bf16_values_give_the_sums_of_the_same_values_in_fp32(dim):
    """A bf16 cache's values are widened 32 at a time and re-interleaved: with fp32 activations
    (scores in fp32 either way) the output is an fp32 cache's of the same values, bit for bit."""
    history = torch.randn(LAYERS, KV_HEADS, 30, dim).bfloat16()
    qkv = torch.randn(3, (HEADS + 2 * KV_HEADS) * dim)
    qkv[:, HEADS * dim:(HEADS + KV_HEADS) * dim] = 0  # keys rotate to exact zeros
    qkv[:, (HEADS + KV_HEADS) * dim:] = qkv[:, (HEADS + KV_HEADS) * dim:].bfloat16().float()
    outs = []
    for cache_dtype in (torch.bfloat16, torch.float32):
        keys, values = cache(cache_dtype, dim=dim)
        keys[:, :, :30], values[:, :, :30] = history, history.flip(0)
        outs.append(attend(qkv, torch.arange(30, 33), [(keys, values, 30, 3)]))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16])
def test_the_attention_does_not_depend_on_the_thread_count(cache_dtype, rows):
    # long enough that a row's key heads are split between threads, and at 4 threads a key
    # head's query heads between tasks (one row, two key heads)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM).bfloat16()
    history = torch.randn(LAYERS, KV_HEADS, 1000, DIM).to(cache_dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            keys, values = cache(cache_dtype, 1024)
            keys[:, :, :1000], values[:, :, :1000] = history, history.flip(0)
            outs.append(attend(qkv, torch.arange(1000, 1000 + rows), [(keys, values, 1000, rows)]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_attend_reads_and_writes_a_pool_slots_strided_cache():
    """A `CachePool` slot: [layers, kv_heads, max_len, dim] strided over the pool's slots."""
    pool_k = torch.zeros(LAYERS, 3, KV_HEADS, MAX_LEN, DIM)
    pool_v = torch.zeros_like(pool_k)
    keys, values = pool_k[:, 1], pool_v[:, 1]
    keys[:, :, :20] = torch.randn(LAYERS, KV_HEADS, 20, DIM)
    values[:, :, :20] = torch.randn(LAYERS, KV_HEADS, 20, DIM)
    qkv = torch.randn(4, (HEADS + 2 * KV_HEADS) * DIM).bfloat16()
    positions = torch.arange(20, 24)
    got = attend(qkv, positions, [(keys, values, 20, 4)])
    torch.testing.assert_close(got.double(), reference(qkv, positions, keys, values),
                               rtol=2 ** -7, atol=2 ** -7)
    assert pool_k[1, 1, :, 20:24].any() and not pool_k[:, 0].any() and not pool_k[:, 2].any()
    assert not pool_v[:, 0].any() and not pool_v[:, 2].any()


def test_attend_refuses_parts_outside_their_cache_or_not_adding_up():
    keys, values = cache(torch.float32)
    qkv = torch.randn(2, (HEADS + 2 * KV_HEADS) * DIM)
    with pytest.raises(RuntimeError, match="lie in its cache"):
        attend(qkv, torch.arange(MAX_LEN - 1, MAX_LEN + 1), [(keys, values, MAX_LEN - 1, 2)])
    with pytest.raises(RuntimeError, match="add up"):
        attend(qkv, torch.arange(2), [(keys, values, 0, 1)])
    with pytest.raises(RuntimeError, match="heads do not match"):
        ops().attend(qkv[:, :-1].contiguous(), *rope(torch.arange(2), qkv.dtype), [keys],
                     [values], [0], [2], 0, HEADS, KV_HEADS, 1.0)


def test_attend_refuses_caches_that_do_not_match_or_share_a_tensor():
    keys, values = cache(torch.float32)
    qkv = torch.randn(2, (HEADS + 2 * KV_HEADS) * DIM)
    with pytest.raises(RuntimeError, match="caches must match"):
        attend(qkv, torch.arange(2), [(keys, values.bfloat16(), 0, 2)])
    with pytest.raises(RuntimeError, match="must be apart"):
        attend(qkv, torch.arange(2), [(keys, keys, 0, 2)])
    with pytest.raises(RuntimeError, match=r"\[layers, kv_heads"):
        attend(qkv, torch.arange(2), [(keys, values, 0, 2)], layer=LAYERS)
    with pytest.raises(RuntimeError, match="contiguous"):
        attend(torch.randn(qkv.shape[1], 2).t(), torch.arange(2), [(keys, values, 0, 2)])


def test_a_nan_value_is_written_to_a_bf16_cache_as_a_nan():
    """A NaN whose payload lies only in the low 16 bits would round to the top 16 as Inf."""
    qkv = torch.randn(1, (HEADS + 2 * KV_HEADS) * DIM)
    qkv[0, -1] = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)
    keys, values = cache(torch.bfloat16)
    attend(qkv, torch.tensor([0]), [(keys, values, 0, 1)])
    assert values[1, -1, 0, -1].isnan() and not values[1, -1, 0, :-1].isnan().any()
