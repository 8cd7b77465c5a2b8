"""The lean forward for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2), gpt-fast style.

Built over a loaded Hugging Face model's weights, in one of the lean formats: fused QKV and
gate/up projections, a static KV cache written in place, `scaled_dot_product_attention`, and a
few dozen operators per layer where HF's eager model issues ~50 (about 10 on a CPU where our own
layer ops run, `layer_ops.cpp`). HF's model stays the reference (the formats' agreement is
measured against it) and the fallback for other architectures.

Numerics follow HF's: RMSNorm in fp32, rotary tables from the model's own `rotary_emb` (so every
rope scaling HF knows, Llama 3's included), logits in fp32. Attention (and the KV cache) runs in
the activation dtype, or in fp32 where that measures faster: a CPU without native bf16 (AVX2 only)
runs a bf16 `bmm` 3-17x slower than an fp32 one (`fastest_attention_dtype`).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llm_engine.lean import int_kernel, linear
from llm_engine.lean.gguf import Q4Weight, Q8Weight, read_q4_1, read_q8_0_head

SUPPORTED = ("llama", "mistral", "qwen2")
FORMATS = ("float32", "bfloat16", "float16", "int8", "q4")
# Forwards of up to ROWS rows attend row-invariantly over keys rounded up to KEY_BLOCK.
ROWS = 16
KEY_BLOCK = 64
# Bumped when a format's arithmetic changes (3: q4's head from a GGUF's Q8_0 codes), so that the
# invariance probes, costs, threads and format choices cached under the old one are measured again.
REVISION = 3


def whole_key_blocks(positions: int) -> int:
    """`positions` rounded up to whole key blocks."""
    return -(-positions // KEY_BLOCK) * KEY_BLOCK


def supports(model: nn.Module) -> str | None:
    """None when the lean forward can run this model, else why not."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"the lean forward covers {', '.join(SUPPORTED)}, not {kind}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act} is not silu"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(config, "rope_scaling", None) and \
            (config.rope_scaling.get("rope_type") or config.rope_scaling.get("type")) == "dynamic":
        return "dynamic rope scaling"
    return None


def own_ops_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether our own layer ops run a forward on `device` in activation `dtype`: a CPU where
    our kernels run (`int_kernel.enabled`), in fp32 or bf16 (float16 stays on torch's ops)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) \
        and int_kernel.enabled()


def activation_dtype(fmt: str, device: torch.device) -> torch.dtype:
    if fmt == "float32":
        return torch.float32
    if fmt == "float16":
        return torch.float16
    if fmt in ("int8", "q4") and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def fastest_attention_dtype(model: nn.Module, fmt: str, max_rows: int, keys: int = 256,
                            repeats: int = 15) -> torch.dtype:
    """The format's activation dtype, or fp32 where the attention runs clearly faster in fp32 on
    this machine, with the model's heads. A GPU keeps the activation dtype.

    On torch's ops the measure is the row attention (`_attend_rows`'s two `bmm`s) at 1 row and
    at `max_rows`. With our own layer ops (`LeanLlama.own_ops`) a short forward's attention gets
    the same numbers from either cache (its keys and values are rounded to the activations' type
    before they are written), and a bf16 cache is half the bytes to read; what differs is the
    prefill's SDPA, measured over a chunk of 64 rows.

    The margin (fp32 at most 0.7x) keeps a near tie on the activation dtype; the caller caches the
    answer per machine, so every process attends in the same dtype and says the same things."""
    device = next(model.parameters()).device
    dtype = activation_dtype(fmt, device)
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    generator = torch.Generator().manual_seed(0)
    groups = heads // kv_heads
    own = own_ops_run(device, dtype)

    def timed(run) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def prefill(kind: torch.dtype) -> float:
        q = torch.randn(1, heads, 64, head_dim, generator=generator).to(kind)
        k = torch.randn(1, kv_heads, keys, head_dim, generator=generator).to(kind)
        visible = torch.ones(64, keys, dtype=torch.bool).tril(keys - 64)
        return timed(lambda: nn.functional.scaled_dot_product_attention(
            q, k, k, attn_mask=visible, enable_gqa=groups > 1))

    def rows(kind: torch.dtype) -> float:
        total = 0.0
        for n in sorted({1, max_rows}):
            q = torch.randn(kv_heads, n * groups, head_dim, generator=generator).to(kind)
            k = torch.randn(kv_heads, keys, head_dim, generator=generator).to(kind)
            total += timed(lambda q=q, k=k: torch.bmm(
                torch.softmax(torch.bmm(q, k.transpose(1, 2)).float(), dim=-1).to(kind), k))
        return total

    cost = prefill if own else rows
    with torch.inference_mode():
        cost(dtype)  # warm both paths before timing
        cost(torch.float32)
        return torch.float32 if cost(torch.float32) < 0.7 * cost(dtype) else dtype


@dataclass
class LeanCache:
    """Keys and values of every layer, [layers, kv_heads, max_len, head_dim]; `length` positions
    are valid. A crop only moves the counter. A cache of a `CachePool` is its slot `slot`."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0
    pool: CachePool | None = None
    slot: int = -1


class CachePool:
    """Caches side by side in one block [layers, slots, kv_heads, max_len, head_dim] (keys, and
    values alike), so that a shared forward attends over the caches of requests in consecutive
    slots with one batched product per layer (`LeanLlama._attend_run`) instead of one per request.

    A slot is taken by `take` and given back when its cache is dropped. It is zeroed where it was
    written before it is handed out again, on the thread that takes it (the engine's worker, not
    the event loop that may drop a session): a masked key's value must be finite, and no call sees
    another's numbers. The block is allocated whole at load."""

    def __init__(self, lean: LeanLlama, slots: int, max_len: int):
        shape = (2, len(lean.layers), slots, lean.kv_heads, max_len, lean.head_dim)
        # Zeroed, so mapped, whole at load: memory a process holds from its start, flat over calls
        # (pages mapped as slots were first written grew a process call after call).
        both = torch.zeros(shape, dtype=lean.attention_dtype, device=lean.device)
        self.k, self.v = both[0], both[1]
        self.slots, self.max_len = slots, max_len
        self._free = list(range(slots))
        self._written = [0] * slots  # per slot, the positions written since it was zeroed
        # Re-entrant: a collection inside `take` may run a dropped cache's `_give_back`.
        self._lock = threading.RLock()

    def take(self) -> LeanCache | None:
        """A cache in the lowest free slot (requests then sit side by side), or None when full."""
        with self._lock:
            if not self._free:
                return None
            slot = min(self._free)
            self._free.remove(slot)
            end, self._written[slot] = self._written[slot], 0
        if end:
            self.k[:, slot, :, :end].zero_()
            self.v[:, slot, :, :end].zero_()
        cache = LeanCache(self.k[:, slot], self.v[:, slot], pool=self, slot=slot)
        weakref.finalize(cache, self._give_back, slot).atexit = False
        return cache

    def wrote(self, slot: int, end: int) -> None:
        self._written[slot] = max(self._written[slot], end)

    def _give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)


@dataclass
class _Part:
    """One sequence of a forward (`LeanLlama.run_many`)."""

    cache: LeanCache
    rows: slice  # its rows in the forward
    start: int  # its first row's position
    positions: torch.Tensor  # [n]
    visible: torch.Tensor  # [n, keys] bool
    pad: int  # its queries padded by this many rows (`attention_rows`)
    # every layer's cache slots for its rows, and the keys and values it attends over
    k_new: torch.Tensor  # [layers, kv_heads, n, dim]
    v_new: torch.Tensor
    k_seen: torch.Tensor  # [layers, kv_heads, keys, dim]
    v_seen: torch.Tensor
    bias: torch.Tensor | None = None  # a short part's additive mask when it attends alone

    @property
    def n(self) -> int:
        return self.rows.stop - self.rows.start

    @property
    def short(self) -> bool:
        """Attended over with `_attend_rows` (else SDPA: prefill)."""
        return self.n <= ROWS


@dataclass
class _Run:
    """Parts of one forward in consecutive slots of a pool, attended over in one product: their
    queries padded alike to `width` rows, their keys to the longest part's (`_attend_run`)."""

    parts: list[_Part]  # in slot order
    width: int  # query rows per part
    keys: int
    # [slots * width] the forward's row each padded query row takes; None: the forward's rows as
    # they are (every part `width` rows, in slot order, the forward's only parts)
    queries: torch.Tensor | None
    outputs: torch.Tensor | None  # [rows] each part row's place among the padded rows; None: all
    rows: torch.Tensor  # [rows] where those rows go in the forward
    # [rows * kv_heads] each row's key (and value) place, per key head, among a layer's keys of
    # the run's slots seen as [slots * kv_heads * max_len] rows of head_dim: one copy writes all
    writes: torch.Tensor
    bias: torch.Tensor  # [slots, 1, width * groups, keys], the same for every key head


class _Layer(nn.Module):
    def __init__(self, qkv, o, gate_up, down, norm1, norm2):
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.norm1, self.norm2 = norm1, norm2


class LeanLlama(nn.Module):
    def __init__(self, model: nn.Module, fmt: str, gguf_file: str | Path | None = None,
                 attention_dtype: torch.dtype | None = None):
        """attention_dtype: the KV cache's and the attention's (default: the activations')."""
        super().__init__()
        reason = supports(model)
        if reason:
            raise ValueError(f"{type(model).__name__}: {reason}")
        if fmt not in FORMATS:
            raise ValueError(f"unknown lean format {fmt!r}; known: {', '.join(FORMATS)}")
        config = model.config
        self.format = fmt
        self.device = next(model.parameters()).device
        if not linear.available(fmt, self.device):
            raise ValueError(f"torch {torch.__version__} has no {fmt} kernel for "
                             f"{self.device.type}; use another engine.format")
        self.dtype = activation_dtype(fmt, self.device)
        self.attention_dtype = attention_dtype or self.dtype
        # Short forwards' queries padded to at least this many rows (0: as they come), where the
        # attention's kernels round a row differently with the row count (the runner's probe).
        self.attention_rows = 0
        # Caches handed out side by side (`CachePool`), and whether a shared forward attends over
        # consecutive slots in one product (set by the runner's probe: a row's numbers unchanged).
        self.pool: CachePool | None = None
        self.batch_attention = False
        # On a CPU where our own kernels run: a layer's norms, SiLU and short forwards' attention
        # as one op each (`layer_ops.cpp`), a row's numbers the same in any forward by design.
        self.own_ops = own_ops_run(self.device, self.dtype)
        if self.own_ops:
            ops = torch.ops.voiceagent_int
            self._own_rms, self._own_silu_mul, self._own_attend = \
                ops.rms.default, ops.silu_mul.default, ops.attend.default
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.vocab = model.config.vocab_size
        decoder = model.get_decoder()
        rotary = decoder.rotary_emb
        self.inv_freq = rotary.inv_freq.float()
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self._rope_cos, self._rope_sin = self._rope_table(0, KEY_BLOCK)
        codes = read_q4_1(gguf_file, self.heads, self.kv_heads) \
            if fmt == "q4" and gguf_file else {}
        params = dict(model.named_parameters())

        def proj(module: nn.Linear) -> nn.Module:
            name = next(n for n, p in params.items() if p is module.weight)
            return self.linear(module, codes.get(name))

        self.layers = nn.ModuleList()
        for block in decoder.layers:
            attn, mlp = block.self_attn, block.mlp
            self.layers.append(_Layer(
                linear.concat([proj(attn.q_proj), proj(attn.k_proj), proj(attn.v_proj)]),
                proj(attn.o_proj),
                linear.concat([proj(mlp.gate_proj), proj(mlp.up_proj)]),
                proj(mlp.down_proj),
                block.input_layernorm.weight.detach().to(self.dtype),
                block.post_attention_layernorm.weight.detach().to(self.dtype),
            ))
        self.norm = decoder.norm.weight.detach().to(self.dtype)
        # A bare decoder (an EAGLE head's layer, `llm_engine.lean.eagle`) has no embeddings or
        # head of its own: it runs on given inputs (`run`) and returns hidden states.
        embed = decoder.embed_tokens
        self.embed = None if embed is None else embed.weight.detach().to(self.dtype)
        head = model.get_output_embeddings()
        q8_head = self._file_head(model, params, gguf_file) if fmt == "q4" and gguf_file else None
        if head is None:
            self.head = None
        elif not isinstance(head, nn.Linear):  # a compact draft's reduced-vocabulary head
            self.head = _OwnHead(head)
        elif fmt in ("float32", "bfloat16", "float16"):
            self.head = self._dense(head)
        elif q8_head is not None:
            # The file's own 8-bit head, unchanged: closer to the reference than one quantised
            # again per channel, and cheaper (`linear.Q8Linear`).
            self.head = linear.Q8Linear(q8_head.codes.to(self.device),
                                        q8_head.scales.to(self.device), self.dtype, _bias(head))
        else:
            self.head = linear.Int8Linear.quantise(head.weight.detach(), self.dtype, _bias(head))
        self.q4_from_file = len(codes)

    @staticmethod
    def _file_head(model: nn.Module, params: dict, gguf_file: str | Path) -> Q8Weight | None:
        """The output head as the file stores it, where that is Q8_0 and `linear.Q8Linear` can
        run it (the model's shape, outputs in fours); else None."""
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            return None
        name = next((n for n, p in params.items() if p is head.weight), None)  # tied: the embedding
        q8 = read_q8_0_head(gguf_file, name) if name else None
        if q8 is None or q8.codes.shape != head.weight.shape or q8.codes.shape[0] % 4:
            return None
        return q8

    def linear(self, module: nn.Linear, q4: Q4Weight | None = None) -> nn.Module:
        """`module` in this forward's format (q4: the file's codes when given)."""
        weight, bias = module.weight.detach(), _bias(module)
        if self.format == "q4":
            if q4 is not None:  # the file's codes, unchanged
                codes, scales, mins = (t.to(self.device) for t in (q4.codes, q4.scales, q4.mins))
                return linear.Int4Linear(codes, scales, mins, self.dtype, _to(bias, self.dtype))
            return linear.Int4Linear.quantise(weight, self.dtype, bias)
        if self.format == "int8":
            return linear.Int8Linear.quantise(weight, self.dtype, bias)
        return self._dense(module)

    def _dense(self, module: nn.Linear) -> linear.DenseLinear:
        return linear.DenseLinear(module.weight.detach().to(self.dtype),
                                  _to(_bias(module), self.dtype))

    def new_cache(self, max_len: int) -> LeanCache:
        """A cache of max_len positions: a free slot of the pool where it has one that long."""
        # whole key blocks, so that a row near the end attends over a block too
        max_len = whole_key_blocks(max_len)
        if self.pool is not None and self.pool.max_len == max_len:
            cache = self.pool.take()
            if cache is not None:
                return cache
        # Keys and values in one zeroed allocation: a row attends over keys up to the next
        # KEY_BLOCK, masked, and a masked key's value must be finite (0 x NaN is NaN). One block
        # of tens of MB is mapped and unmapped whole by the C allocator, where two halves of it
        # would come from its heap and fragment it call after call.
        both = torch.zeros((2, len(self.layers), self.kv_heads, max_len, self.head_dim),
                           dtype=self.attention_dtype, device=self.device)
        return LeanCache(both[0], both[1])

    def rope(self, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, head_dim] of `positions` (all below `end`), read from a table of every
        position so far: its cos and sin were 1-2% of a decode step, computed afresh each one."""
        length = self._rope_cos.shape[0]
        if end > length:  # grown, never recomputed: a position's numbers never change
            cos, sin = self._rope_table(length, whole_key_blocks(max(end, 2 * length)))
            self._rope_cos = torch.cat([self._rope_cos, cos])
            self._rope_sin = torch.cat([self._rope_sin, sin])
        return self._rope_cos[positions], self._rope_sin[positions]

    def _rope_table(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions start .. end - 1, each element as HF's rotary computes it."""
        positions = torch.arange(start, end, device=self.inv_freq.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.rope_scale).to(self.dtype),
                (emb.sin() * self.rope_scale).to(self.dtype))

    def forward(self, ids: torch.Tensor, cache: LeanCache, start: int) -> torch.Tensor:
        """ids [n] at positions start .. start + n - 1 on top of the cache, which gets their keys
        and values. Returns the final hidden states [n, hidden].

        A forward of up to `ROWS` rows (decode and verify) attends with our own `attend` op where
        it runs, else `_attend_rows`; either gives a row the same result whatever the row count.
        Longer ones (prefill) attend with SDPA."""
        return self.run(self.embed[ids], cache, start)

    def run(self, x: torch.Tensor, cache: LeanCache, start: int) -> torch.Tensor:
        """The layers and the final norm over inputs x [n, hidden] (see `forward`)."""
        return self.run_many(x, [(cache, start, x.shape[0])])

    def run_many(self, x: torch.Tensor, parts: list[tuple[LeanCache, int, int]]) -> torch.Tensor:
        """Several sequences in one forward: x [sum n, hidden] holds, in order, the rows of each
        part (cache, start, n). The projections and the MLP run once over every row; each part
        writes its own cache and attends over its own keys: on our own ops every part in one
        `attend` op (`_run_own`), else padded as it would be alone (parts in consecutive pool
        slots in one product, `_attend_run`), so a part's rows come out as they would alone
        wherever the kernels are row-invariant (the runner's probes). A part longer than `ROWS`
        (prefill) runs only alone."""
        x = x.to(self.dtype)
        short = all(n <= ROWS for _, _, n in parts)
        if len(parts) > 1 and not short:
            raise ValueError(f"only forwards of at most {ROWS} rows share a forward")
        if short and self.own_ops:
            return self._run_own(x, parts)
        offsets = [0]
        for _, _, n in parts:
            offsets.append(offsets[-1] + n)
        plans = [self._plan(cache, start, slice(offsets[j], offsets[j + 1]), x.device)
                 for j, (cache, start, _) in enumerate(parts)]
        runs = self._runs(plans, offsets[-1]) if self.batch_attention and len(plans) > 1 else []
        alone = [plan for plan in plans if not any(plan is p for run in runs for p in run.parts)]
        for plan in alone:
            if plan.short:
                plan.bias = self._mask(plan.visible, plan.n + plan.pad)
        positions = plans[0].positions if len(plans) == 1 else \
            torch.cat([plan.positions for plan in plans])
        cos, sin = self.rope(positions, max(start + n for _, start, n in parts))
        rows = x.shape[0]
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(self._rms(x, layer.norm1))
            # queries and keys rotated in one pass: elementwise, so the same numbers as apart
            qk = _rotate(qkv[:, :q_width + kv_width].view(rows, -1, self.head_dim), cos, sin)
            q, k = qk[:, :self.heads].to(self.attention_dtype), qk[:, self.heads:]
            v = qkv[:, q_width + kv_width:].view(rows, self.kv_heads, self.head_dim)
            if len(plans) == 1:
                attn = self._attend(i, plans[0], q, k, v)
            elif not runs:
                attn = torch.cat([self._attend(i, plan, q[plan.rows], k[plan.rows], v[plan.rows])
                                  for plan in plans])
            elif runs[0].queries is None:  # one run holds every row, in order
                attn = self._attend_run(i, runs[0], q, k, v)
            else:
                attn = q.new_empty(rows, q_width)
                for plan in alone:
                    attn[plan.rows] = self._attend(i, plan, q[plan.rows], k[plan.rows],
                                                   v[plan.rows])
                for run in runs:
                    attn.index_copy_(0, run.rows, self._attend_run(i, run, q, k, v))
            x = x + layer.o(attn.to(self.dtype))
            x = x + layer.down(self._silu_mul(layer.gate_up(self._rms(x, layer.norm2))))
        return self._rms(x, self.norm)

    def _run_own(self, x: torch.Tensor, parts: list[tuple[LeanCache, int, int]]) -> torch.Tensor:
        """`run_many` of short parts on our own ops: per layer, the norms, the products, one
        attention op over every part (rotary, cache writes, each row over its own part's keys up
        to its position) and one SiLU op."""
        rms, silu_mul, attend = self._own_rms, self._own_silu_mul, self._own_attend
        x = x.contiguous()
        positions = torch.cat([torch.arange(start, start + n) for _, start, n in parts]) \
            if len(parts) > 1 else torch.arange(parts[0][1], parts[0][1] + parts[0][2])
        for cache, start, n in parts:
            if cache.pool is not None:
                cache.pool.wrote(cache.slot, start + n)
        cos, sin = self.rope(positions.to(x.device), max(start + n for _, start, n in parts))
        keys, values = [c.k for c, _, _ in parts], [c.v for c, _, _ in parts]
        starts, counts = [start for _, start, _ in parts], [n for _, _, n in parts]
        scale = self.head_dim ** -0.5
        for i, layer in enumerate(self.layers):
            attn = attend(layer.qkv(rms(x, layer.norm1, self.eps)), cos, sin, keys, values,
                          starts, counts, i, self.heads, self.kv_heads, scale)
            x = x + layer.o(attn)
            x = x + layer.down(silu_mul(layer.gate_up(rms(x, layer.norm2, self.eps))))
        return rms(x, self.norm, self.eps)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.own_ops:
            return self._own_rms(x.contiguous(), weight, self.eps)
        return _rms(x, weight, self.eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.own_ops:
            return self._own_silu_mul(gate_up.contiguous())
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up

    def _plan(self, cache: LeanCache, start: int, rows: slice, device: torch.device) -> _Part:
        """What a part's attention needs in every layer: its positions, the keys it attends
        over, and for a short part its queries padded (`attention_rows`)."""
        n = rows.stop - rows.start
        positions = torch.arange(start, start + n, device=device)
        short = n <= ROWS
        keys = whole_key_blocks(start + n) if short else start + n
        visible = torch.arange(keys, device=device)[None, :] <= positions[:, None]
        pad = max(self.attention_rows - n, 0) if short else 0  # queries padded to a least count
        if cache.pool is not None:
            cache.pool.wrote(cache.slot, start + n)
        return _Part(cache, rows, start, positions, visible, pad,
                     cache.k[:, :, start:start + n], cache.v[:, :, start:start + n],
                     cache.k[:, :, :keys], cache.v[:, :, :keys])

    def _mask(self, visible: torch.Tensor, rows: int) -> torch.Tensor:
        """The additive mask of `visible` [n, keys], its last row repeated to `rows` rows (the
        padded queries), one row per (query, head) of a key head: [rows * groups, keys]."""
        if rows > visible.shape[0]:
            visible = torch.cat([visible, visible[-1:].expand(rows - visible.shape[0], -1)])
        return self._additive(visible)

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """visible [..., rows, keys] as an additive mask, each row repeated for the query heads
        of a key head: [..., rows * groups, keys]."""
        return torch.zeros(visible.shape, device=visible.device).masked_fill_(
            ~visible, float("-inf")).repeat_interleave(self.heads // self.kv_heads, dim=-2)

    def _runs(self, plans: list[_Part], rows: int) -> list[_Run]:
        """The forward's short parts in consecutive slots of the pool, two or more to a run."""
        pooled = sorted((p for p in plans if p.cache.pool is self.pool and p.short),
                        key=lambda p: p.cache.slot)
        groups: list[list[_Part]] = []
        for part in pooled:
            if groups and part.cache.slot == groups[-1][-1].cache.slot + 1:
                groups[-1].append(part)
            else:
                groups.append([part])
        return [self._run(group, rows) for group in groups if len(group) > 1]

    def _run(self, parts: list[_Part], forward_rows: int) -> _Run:
        """A run's padded queries, where its rows go, and its mask over the longest part's keys:
        a part's padded rows repeat its last row, as alone (`_attend`, `_mask`)."""
        width = max(max(p.n for p in parts), self.attention_rows)
        keys = max(p.k_seen.shape[2] for p in parts)
        device = parts[0].positions.device
        first, max_len = parts[0].cache.slot, self.pool.max_len
        queries, outputs, rows, writes, positions = [], [], [], [], []
        for j, part in enumerate(parts):
            start, n = part.rows.start, part.n
            queries += [start + min(r, n - 1) for r in range(width)]
            outputs += [j * width + r for r in range(n)]
            rows += range(start, start + n)
            writes += [((part.cache.slot - first) * self.kv_heads + h) * max_len + p
                       for p in range(part.start, part.start + n) for h in range(self.kv_heads)]
            positions.append([part.start + min(r, n - 1) for r in range(width)])
        index = lambda values: torch.tensor(values, device=device)  # noqa: E731
        as_they_are = queries == list(range(forward_rows))  # then outputs are too
        # every part's mask as `_mask` has it alone (padded rows repeat the last), per key head
        visible = torch.arange(keys, device=device) <= index(positions)[..., None]
        return _Run(parts, width, keys, None if as_they_are else index(queries),
                    None if as_they_are else index(outputs), index(rows), index(writes),
                    self._additive(visible)[:, None])

    def _attend_run(self, i: int, run: _Run, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> torch.Tensor:
        """Layer i's attention for a run of parts in one product over their slots, each part's
        query rows and keys as `_attend_rows` has them alone (the masked keys past a part's own
        add exact zeros). Returns the run's rows [rows, heads * dim], in `run.rows` order."""
        slots, groups, dim = len(run.parts), self.heads // self.kv_heads, self.head_dim
        first = run.parts[0].cache.slot
        # every part's new keys and values in one copy each (a copy per part cost 4x as much)
        for new, pool in ((k, self.pool.k), (v, self.pool.v)):
            rows = new if run.queries is None else new.index_select(0, run.rows)
            pool[i, first:first + slots].view(-1, dim).index_copy_(
                0, run.writes, rows.to(pool.dtype).reshape(-1, dim))
        # [slots, kv_heads, keys, dim] as [slots * kv_heads, keys, dim]: a view, no copy
        keys = self.pool.k[i, first:first + slots, :, :run.keys].flatten(0, 1)
        values = self.pool.v[i, first:first + slots, :, :run.keys].flatten(0, 1)
        grouped = q if run.queries is None else q.index_select(0, run.queries)
        grouped = grouped.view(slots, run.width, self.kv_heads, groups, dim) \
            .permute(0, 2, 1, 3, 4).reshape(slots * self.kv_heads, -1, dim)
        scores = torch.bmm(grouped, keys.transpose(1, 2)).float().mul_(dim ** -0.5)
        scores = scores.view(slots, self.kv_heads, *scores.shape[1:]).add_(run.bias)
        probs = torch.softmax(scores, dim=-1).to(q.dtype).flatten(0, 1)
        out = torch.bmm(probs, values).view(slots, self.kv_heads, run.width, groups, dim)
        out = out.permute(0, 2, 1, 3, 4).reshape(slots * run.width, self.heads * dim)
        return out if run.outputs is None else out.index_select(0, run.outputs)

    def _attend(self, i: int, part: _Part, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Layer i's attention for one part: its keys and values written to its cache, its
        queries [n, heads, dim] over the keys it sees. Returns [n, heads * dim]."""
        n = part.n
        part.k_new[i].copy_(k.transpose(0, 1))
        part.v_new[i].copy_(v.transpose(0, 1))
        keys, values = part.k_seen[i], part.v_seen[i]
        if not part.short:
            return nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys[None], values[None], attn_mask=part.visible,
                enable_gqa=self.heads != self.kv_heads)[0].transpose(0, 1).reshape(n, -1)
        padded = torch.cat([q, q[-1:].expand(part.pad, -1, -1)]) if part.pad else q
        return self._attend_rows(padded, keys, values, part.bias)[:n]

    def _attend_rows(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
        """q [n, heads, dim] over keys/values [kv_heads, L, dim], L a multiple of KEY_BLOCK.

        Each query row is reduced over the same L whatever the row count, the masked keys adding
        exact zeros, so a row's output is the same in a 1-row step and in a verify (checked at
        load by `llm_engine.lean.runner.probe_invariance`, for the kernels at hand)."""
        n, groups = q.shape[0], self.heads // self.kv_heads
        grouped = q.view(n, self.kv_heads, groups, self.head_dim).permute(1, 0, 2, 3)
        scores = torch.bmm(grouped.reshape(self.kv_heads, n * groups, self.head_dim),
                           keys.transpose(1, 2)).float().mul_(self.head_dim ** -0.5)
        probs = torch.softmax(scores.add_(bias), dim=-1).to(q.dtype)
        out = torch.bmm(probs, values)  # [kv_heads, n * groups, dim]
        return out.view(self.kv_heads, n, groups, self.head_dim).permute(1, 0, 2, 3) \
            .reshape(n, self.heads * self.head_dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()


class _OwnHead(nn.Module):
    """A head that is not a plain linear layer, run as it is, in its own dtype."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.module = head
        self.dtype = next(head.parameters()).dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.module(hidden.to(self.dtype))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _bias(module: nn.Linear) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach()


def _to(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)
