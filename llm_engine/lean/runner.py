"""`LeanRunner`: the target through the lean forward (`llm_engine.lean.llama`), in a lean format.

Speculation is lossless only if a position's logits do not depend on how many rows the forward
carried: a plain step runs 1 row, a verify k + 1, and greedy output must be token-identical.
`probe_invariance` checks that on the machine at hand, for every row count the engine uses and
every row, bit for bit. Three rungs, each probed again, the cheapest that holds kept:
- "as-is": rows run as they come (the q4 and int8 kernels and bf16 attention on the CPUs
  measured so far);
- "attention padded": only the attention's queries are padded, to 2 rows, else to the verify's
  row count (fp32 attention on an AVX2 EPYC, whose `bmm` rounds a 1-row product differently from
  a longer one: padded to 2 rows it costs ~nothing, to 12 rows ~3 ms a step, where padding the
  whole forward cost ~60 ms);
- "padded": every short forward runs in the verify's shape, plain steps too.
The runner records which (`rows`) and whether it holds (`bit_identical`).

Where rows run as they come, requests share forwards (`forward_many`), and their caches sit side
by side in a `CachePool`, so a shared forward attends over consecutive slots in one product per
layer. `probe_shared` checks that a part's logits there are bit for bit its logits alone, over
caches of other lengths; where they are not, each part attends alone, as before.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from llm_engine.lean.llama import ROWS, CachePool, LeanCache, LeanLlama, whole_key_blocks
from llm_engine.runner import Forward, TargetRunner

log = logging.getLogger(__name__)


class LeanRunner(TargetRunner):
    name = "lean"

    def __init__(self, model: nn.Module, fmt: str, max_cache_len: int, max_rows: int,
                 gguf_file: str | Path | None = None, probe: bool = True,
                 attention_dtype: torch.dtype | None = None, probed: dict | None = None,
                 cache_slots: int = 0):
        """probe=False: a draft's runner, whose rows need not be invariant (the target's
        verification keeps the output exact whatever a draft proposes). attention_dtype: see
        `llm_engine.lean.llama.fastest_attention_dtype` (default: the activations'). probed: a
        `probe_result` of this machine, model, format and attention dtype, taken instead of
        probing again (seconds of every start). cache_slots: caches in the pool of a runner
        that shares forwards (0: each cache its own allocation)."""
        super().__init__(model)
        if max_rows > ROWS:
            raise ValueError(f"the lean runner verifies at most {ROWS} rows, not {max_rows}")
        self.lean = LeanLlama(model, fmt, gguf_file, attention_dtype)
        self.dtype = self.lean.dtype
        self._format = fmt
        self.max_cache_len = max_cache_len
        self.max_rows = max_rows
        self.pad_to = 0  # 0: rows as they come
        if probe and probed is not None:
            self.lean.attention_rows = probed["attention_rows"]
            self.pad_to, self.bit_identical = probed["pad_to"], probed["bit_identical"]
            self._pool(cache_slots, probed["batch_attention"])
            return
        self.bit_identical = probe_invariance(self, max_rows) if probe else None
        # Then the attention's queries only, to 2 rows (the fp32 bmm on an AVX2 EPYC rounds
        # only a 1-row product differently) or to all of them: a few ms a step at most.
        for attention_rows in sorted({min(2, max_rows), max_rows}):
            if self.bit_identical is not False:
                break
            self.lean.attention_rows = attention_rows
            self.bit_identical = probe_invariance(self, max_rows)
        if self.bit_identical is False:
            self.pad_to = max_rows
            self.bit_identical = probe_invariance(self, max_rows)
            if not self.bit_identical:
                log.warning("lean %s: a position's logits depend on the forward's row count "
                            "even in one shape; speculation may differ from plain decoding", fmt)
        if probe:
            self._pool(cache_slots, None)

    def _pool(self, slots: int, batch_attention: bool | None) -> None:
        """The cache pool of a runner that shares forwards, and whether a run of its slots
        attends in one product (None: probe it)."""
        if slots < 2 or not self.shared_rows:
            return
        self.lean.pool = CachePool(self.lean, slots, whole_key_blocks(self.max_cache_len))
        if batch_attention is None:
            self.lean.batch_attention = True
            batch_attention = probe_shared(self)
            if not batch_attention:
                log.info("lean %s: a shared forward's rows differ when attended in one product "
                         "here; each request attends alone", self._format)
        self.lean.batch_attention = batch_attention

    @property
    def format(self) -> str:
        return self._format

    @property
    def shared_rows(self) -> int:
        """Several requests' rows share one forward up to the probed row count, where rows run
        as they come: the probe showed every kernel gives a row the same numbers in any forward
        of up to that many rows. A runner that pads whole forwards runs them one by one."""
        return 0 if self.pad_to else self.max_rows

    @property
    def probe_result(self) -> dict:
        return {"attention_rows": self.lean.attention_rows, "pad_to": self.pad_to,
                "bit_identical": self.bit_identical, "batch_attention": self.lean.batch_attention}

    @property
    def rows(self) -> str:
        if self.pad_to:
            return "padded"
        rows = self.lean.attention_rows
        return f"attention padded to {rows}" if rows else "as-is"

    def new_cache(self) -> LeanCache:
        return self.lean.new_cache(self.max_cache_len)

    copies_prefixes = True

    def copy_prefix(self, cache: LeanCache, length: int, compact: bool = False) -> LeanCache:
        copy = self.lean.new_cache(length if compact else self.max_cache_len)
        copy.k[:, :, :length] = cache.k[:, :, :length]
        copy.v[:, :, :length] = cache.v[:, :, :length]
        copy.length = length
        if copy.pool is not None:
            copy.pool.wrote(copy.slot, length)
        return copy

    def length(self, cache: LeanCache) -> int:
        return cache.length

    def crop(self, cache: LeanCache, length: int) -> None:
        cache.length = min(cache.length, length)

    @torch.inference_mode()
    def forward(self, cache: LeanCache, input_ids: torch.Tensor,
                last_only: bool = False) -> Forward:
        ids = input_ids[0]
        n, start = ids.shape[0], cache.length
        if start + n > self.max_cache_len:
            raise ValueError(f"{start + n} positions exceed the cache ({self.max_cache_len})")
        run = ids
        if n < self.pad_to and start + self.pad_to <= self.max_cache_len:
            # The padding's keys land past the cache's length: never attended, overwritten later.
            run = torch.cat([ids, ids[-1:].expand(self.pad_to - n)])
        hidden = self.lean(run, cache, start)[:n]
        cache.length = start + n
        return Forward(self.lean.logits(hidden[-1:] if last_only else hidden), hidden)

    @torch.inference_mode()
    def forward_many(self, steps: list[tuple[LeanCache, torch.Tensor]]) -> list[Forward]:
        rows = sum(ids.shape[1] for _, ids in steps)
        if len(steps) < 2 or rows > self.shared_rows:
            return super().forward_many(steps)
        if len({id(cache) for cache, _ in steps}) < len(steps):
            raise ValueError("two requests of one forward share a cache")
        parts = []
        for cache, ids in steps:
            if cache.length + ids.shape[1] > self.max_cache_len:
                raise ValueError(f"{cache.length + ids.shape[1]} positions exceed the cache "
                                 f"({self.max_cache_len})")
            parts.append((cache, cache.length, ids.shape[1]))
        ids = torch.cat([ids[0] for _, ids in steps])
        hidden = self.lean.run_many(self.lean.embed[ids], parts)
        logits = self.lean.logits(hidden)
        out, first = [], 0
        for cache, start, n in parts:
            cache.length = start + n
            out.append(Forward(logits[first:first + n], hidden[first:first + n]))
            first += n
        return out


@torch.inference_mode()
def probe_invariance(runner: LeanRunner, max_rows: int, context: int = 70) -> bool:
    """Whether every row of every forward of 2 .. max_rows rows gives the logits of the same
    position run alone, bit for bit, at two offsets within a key block and across one."""
    vocab = runner.lean.vocab
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context + max_rows + 4), generator=generator)
    ids = ids.to(runner.device)
    cache = runner.new_cache()
    for start in (context - 14, context - 4):  # the second spans a key-block edge (64)
        runner.crop(cache, 0)
        runner.forward(cache, ids[:, :start], last_only=True)
        alone = torch.cat([runner.forward(cache, ids[:, start + j:start + j + 1]).logits
                           for j in range(max_rows)])
        for rows in range(2, max_rows + 1):
            runner.crop(cache, start)
            together = runner.forward(cache, ids[:, start:start + rows]).logits
            if not torch.equal(together, alone[:rows]):
                return False
    return True


@torch.inference_mode()
def probe_shared(runner: LeanRunner) -> bool:
    """Whether the parts of a shared forward give each part's logits alone, bit for bit, over
    every slot of the pool at once (the most a run holds), over the first two (the least), and out
    of slot order: caches of 20 positions up to the longest a cache takes, with 1 to 3 rows
    each, as many rows as a forward shares; and with one row each in slot order (a decode step,
    which a run takes as its rows come)."""
    pool = runner.lean.pool
    parts = min(pool.slots, runner.shared_rows)
    caches = [runner.new_cache() for _ in range(parts)]
    if parts < 2 or any(cache.pool is not pool for cache in caches):
        return False
    # short ones in a few key blocks, and the longest a cache takes: every part attends over its
    # keys (prefilling long ones for each part would cost seconds more at a machine's first load)
    longest = runner.max_cache_len - ROWS
    lengths = [min(20 + 60 * j, longest // 2) for j in range(parts - 1)] + [longest]
    widths = [1, 3, 2, *[1] * parts][:parts]
    while sum(widths) > runner.shared_rows:
        widths[widths.index(max(widths))] -= 1
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, runner.lean.vocab, (1, n + w), generator=generator).to(runner.device)
           for n, w in zip(lengths, widths, strict=True)]
    alone = []
    for cache, seq, n in zip(caches, ids, lengths, strict=True):
        runner.forward(cache, seq[:, :n], last_only=True)
        alone.append(runner.forward(cache, seq[:, n:]).logits)
    for order in (list(range(parts)), list(reversed(range(parts))), [0, 1]):
        for j in order:
            runner.crop(caches[j], lengths[j])
        together = runner.forward_many([(caches[j], ids[j][:, lengths[j]:]) for j in order])
        if not all(torch.equal(out.logits, alone[j])
                   for j, out in zip(order, together, strict=True)):
            return False
    one_row = [ids[j][:, lengths[j]:lengths[j] + 1] for j in range(parts)]
    alone = []
    for cache, n, row in zip(caches, lengths, one_row, strict=True):
        runner.crop(cache, n)
        alone.append(runner.forward(cache, row).logits)
        runner.crop(cache, n)
    together = runner.forward_many(list(zip(caches, one_row, strict=True)))
    return all(torch.equal(out.logits, logits) for out, logits in zip(together, alone, strict=True))
