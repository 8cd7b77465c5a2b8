"""Several requests' decode and verify rows in one target forward (`SpeculativeEngine.step_many`,
`LeanRunner.forward_many`): each request gets what it would alone, bit for bit, on tiny random
Llamas in the lean formats, with each request attending alone and with the pooled caches'
requests attending in one product (`CachePool`)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from llm_engine.config import EngineConfig, SamplingConfig, SpeculationConfig
from llm_engine.cost_model import cpu_model
from llm_engine.engine import SpeculativeEngine
from llm_engine.lean.runner import LeanRunner, probe_shared
from llm_engine.serving import EngineWorker
from tests.llm_engine.requests import run
from tests.llm_engine.test_engine import NEW_TOKENS, random_prompts
from tests.llm_engine.test_lean import LEAN_FORMATS, MAX_ROWS, invariant


def engine(target, tokenizer, runner, method="off", **sampling) -> SpeculativeEngine:
    config = EngineConfig(
        sampling=SamplingConfig(max_new_tokens=NEW_TOKENS, **sampling), max_context=256,
        speculation=SpeculationConfig(method=method, max_draft_tokens=MAX_ROWS - 1, gate=False))
    return SpeculativeEngine(target, tokenizer, config, runner=runner)


def step_together(engine: SpeculativeEngine, prompts, cancel_at: dict[int, int] | None = None):
    """Every request stepped with `step_many` until all end; request j cancelled after
    `cancel_at[j]` steps. Returns each one's tokens."""
    states = [engine.start(p) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    steps = 0
    while not all(s.finished for s in states):
        steps += 1
        for j, after in (cancel_at or {}).items():
            if steps == after:
                states[j].cancel()
        live = [j for j, s in enumerate(states) if not s.finished]
        for j, result in zip(live, engine.step_many([states[j] for j in live]), strict=True):
            assert not isinstance(result, Exception), result
            tokens[j] += result
    for state in states:
        engine.release(state)
    return tokens


SLOTS = 4
# `_attend_run`, the one product over pooled caches, is on torch's ops: our own attend every part
# in one op of their own
torch_ops = pytest.mark.parametrize("int_kernel_choice", ["torch"], indirect=True)


def pooled(target, fmt: str = "q4", attention: torch.dtype | None = None) -> LeanRunner:
    """A runner with a cache pool whose runs attend in one product here; else a visible skip."""
    runner = invariant(target, fmt, attention, cache_slots=SLOTS)
    if not runner.lean.batch_attention:
        pytest.skip(f"{fmt}: one product over the slots rounds differently on {cpu_model()}")
    return runner


def attending(runner: LeanRunner, runs: list[int]):
    """Counts `_attend_run`'s parts per call into `runs`."""
    attend_run = runner.lean._attend_run

    def counted(i, run, *args):
        runs.append(len(run.parts))
        return attend_run(i, run, *args)
    runner.lean._attend_run = counted


@pytest.mark.parametrize("pool, attention, reverse", [
    (False, None, True), (True, None, True), (True, None, False), (True, torch.float32, True)],
    ids=["each-alone", "one-product", "one-product-in-slot-order", "one-product-fp32-cache"])
@pytest.mark.parametrize("fmt", LEAN_FORMATS)
def test_a_shared_forward_gives_each_request_its_own_logits_bit_for_bit(target, fmt, pool,
                                                                        attention, reverse,
                                                                        int_kernel_choice):
    runner = pooled(target, fmt, attention) if pool else invariant(target, fmt)
    # our own layer ops attend every part in one op of their own, never through `_attend_run`
    assert runner.lean.own_ops == (int_kernel_choice == "own")
    runs: list[int] = []
    attending(runner, runs)
    prompts = random_prompts(target.config.vocab_size, 3, seed=21)
    caches, steps = [], []
    with torch.inference_mode():
        for j, prompt in enumerate(prompts):  # different lengths, one across a key block
            cache = runner.new_cache()
            runner.forward(cache, torch.tensor([(prompt * 8)[:40 + 11 * j]]))
            caches.append(cache)
            steps.append(torch.tensor([prompt[:1 + j]]))  # 1, 2 and 3 rows
        starts = [c.length for c in caches]
        if reverse:  # out of slot order
            caches, steps, starts = caches[::-1], steps[::-1], starts[::-1]
        together = runner.forward_many(list(zip(caches, steps, strict=True)))
        one_product = pool and not runner.lean.own_ops
        assert runs == ([3] * target.config.num_hidden_layers if one_product else [])
        for cache, start, ids, shared in zip(caches, starts, steps, together, strict=True):
            assert cache.length == start + ids.shape[1]
            runner.crop(cache, start)
            alone = runner.forward(cache, ids)
            assert torch.equal(shared.logits, alone.logits)
            assert torch.equal(shared.hidden, alone.hidden)


@pytest.mark.parametrize("attention", [None, torch.float32], ids=["cache-as-activations",
                                                                  "fp32-cache"])
@pytest.mark.parametrize("fmt", LEAN_FORMATS)
@torch_ops
def test_decode_rows_in_slot_order_attend_as_they_come_and_keep_their_logits(target, fmt,
                                                                           attention,
                                                                           int_kernel_choice):
    """One row a request, in slot order, the run holding every row: the shortcut that skips the
    run's row gathers and writes every cache's keys in one copy gives each row its logits alone."""
    runner = pooled(target, fmt, attention)
    if runner.lean.attention_rows > 1:
        pytest.skip(f"{fmt}: queries padded to {runner.lean.attention_rows} rows on {cpu_model()}")
    runs = []
    attend_run = runner.lean._attend_run
    runner.lean._attend_run = lambda i, run, *a: runs.append(run.queries) or attend_run(i, run, *a)
    prompts = random_prompts(target.config.vocab_size, SLOTS, seed=23)
    with torch.inference_mode():
        caches = [runner.new_cache() for _ in prompts]
        for j, (cache, prompt) in enumerate(zip(caches, prompts, strict=True)):
            runner.forward(cache, torch.tensor([(prompt * 8)[:30 + 17 * j]]))  # across key blocks
        starts = [c.length for c in caches]
        steps = [torch.tensor([prompt[-1:]]) for prompt in prompts]
        together = runner.forward_many(list(zip(caches, steps, strict=True)))
        assert runs and all(queries is None for queries in runs)
        for cache, start, ids, shared in zip(caches, starts, steps, together, strict=True):
            runner.crop(cache, start)
            alone = runner.forward(cache, ids)
            assert torch.equal(shared.logits, alone.logits)
            assert torch.equal(shared.hidden, alone.hidden)


@torch_ops
def test_requests_past_the_pool_get_their_own_cache_and_attend_alone(target, int_kernel_choice):
    runner = pooled(target)
    runs: list[int] = []
    attending(runner, runs)
    prompts = [(p * 8)[:31] for p in random_prompts(target.config.vocab_size, SLOTS + 1, seed=22)]
    with torch.inference_mode():
        caches = [runner.new_cache() for _ in prompts]
        assert [c.slot for c in caches] == [*range(SLOTS), -1]
        for cache, prompt in zip(caches, prompts, strict=True):
            runner.forward(cache, torch.tensor([prompt[:30]]))
        steps = [torch.tensor([prompt[30:]]) for prompt in prompts]
        together = runner.forward_many(list(zip(caches, steps, strict=True)))
        assert set(runs) == {SLOTS}  # the pooled four in one product, the fifth alone
        for cache, ids, shared in zip(caches, steps, together, strict=True):
            runner.crop(cache, 30)
            assert torch.equal(shared.logits, runner.forward(cache, ids).logits)


@torch_ops
def test_the_probe_turns_the_one_product_off_where_it_changes_a_row(target, int_kernel_choice):
    runner = pooled(target)
    assert probe_shared(runner)
    attend_run = runner.lean._attend_run
    runner.lean._attend_run = lambda *args: attend_run(*args) * (1 + 2 ** -7)  # one rounding off
    assert not probe_shared(runner)


@torch_ops
def test_the_probe_checks_decode_rows_that_a_run_takes_as_they_come(target, int_kernel_choice):
    runner = pooled(target)
    if runner.lean.attention_rows > 1:
        pytest.skip(f"queries padded to {runner.lean.attention_rows} rows on {cpu_model()}")
    attend_run = runner.lean._attend_run

    def off_as_they_come(i, run, *args):  # one rounding off in the shortcut alone
        out = attend_run(i, run, *args)
        return out * (1 + 2 ** -7) if run.queries is None else out
    runner.lean._attend_run = off_as_they_come
    assert not probe_shared(runner)


def test_a_dropped_cache_gives_its_slot_back_zeroed(target):
    runner = pooled(target)
    pool = runner.lean.pool
    with torch.inference_mode():
        cache = runner.new_cache()
        runner.forward(cache, torch.tensor([random_prompts(target.config.vocab_size, 1)[0] * 3]))
        slot = cache.slot
        assert pool.k[:, slot].abs().sum() > 0 and pool.free == SLOTS - 1
        del cache
        assert pool.free == SLOTS
        again = runner.new_cache()
        assert again.slot == slot  # the lowest free slot, zeroed as it is taken
        assert not pool.k[:, slot].any() and not pool.v[:, slot].any()
        del again
        kept = runner.new_cache()
        runner.forward(kept, torch.tensor([random_prompts(target.config.vocab_size, 1)[0] * 3]))
        prefix = runner.copy_prefix(kept, kept.length, compact=True)  # a kept prefix: no slot
        del kept
        copied = runner.copy_prefix(prefix, prefix.length)  # a session starting from it
        assert prefix.pool is None and copied.slot == slot
        del copied
        assert runner.new_cache().slot == slot
        assert not pool.k[:, slot].any() and not pool.v[:, slot].any()


@pytest.mark.parametrize("method", ["off", "ngram"])
def test_requests_stepped_together_decode_what_each_decodes_alone(target, tokenizer, method):
    runner = pooled(target)
    eng = engine(target, tokenizer, runner, method)
    prompts = random_prompts(len(tokenizer), 4, seed=8)
    alone = [run(eng, p)[0] for p in prompts]
    shared = []
    eng.runner.forward_many = _counting(eng.runner.forward_many, shared)
    assert step_together(eng, prompts) == alone
    assert max(shared) == len(prompts)  # the decode steps did share forwards


def test_a_request_cancelled_mid_batch_leaves_the_others_unchanged(target, tokenizer):
    eng = engine(target, tokenizer, pooled(target), "ngram")
    prompts = random_prompts(len(tokenizer), 3, seed=9)
    alone = [run(eng, p)[0] for p in prompts]
    got = step_together(eng, prompts, cancel_at={1: 4})
    assert got[0] == alone[0] and got[2] == alone[2]
    assert got[1] == alone[1][:len(got[1])] and len(got[1]) < len(alone[1])


def test_one_requests_failure_in_a_shared_step_is_its_own(target, tokenizer):
    eng = engine(target, tokenizer, invariant(target, "q4"), "ngram")
    prompts = random_prompts(len(tokenizer), 3, seed=10)
    alone = [run(eng, p)[0] for p in prompts]
    states = [eng.start(p) for p in prompts]
    eng.step_many(states)  # the prefills
    broken = states[1].proposer

    def propose(ctx):
        raise RuntimeError("drafting broke")

    broken.propose = propose
    first = eng.step_many(states)
    assert isinstance(first[1], RuntimeError)
    assert first[0] == alone[0][1:1 + len(first[0])]
    assert first[2] == alone[2][1:1 + len(first[2])]


async def test_the_serving_worker_shares_forwards_between_live_requests(target, tokenizer):
    eng = engine(target, tokenizer, pooled(target), "off")
    prompts = random_prompts(len(tokenizer), 4, seed=12)
    alone = [run(eng, p)[0] for p in prompts]
    shared = []
    eng.runner.forward_many = _counting(eng.runner.forward_many, shared)
    serving = EngineWorker(eng)
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(serving.generate(p) for p in prompts)), 60)
    finally:
        serving.close()
    assert [r.token_ids for r in results] == alone
    assert max(shared) >= 2


def _counting(forward_many, sizes: list[int]):
    def counted(steps):
        sizes.append(len(steps))
        return forward_many(steps)
    return counted


def test_a_shared_forward_that_fails_is_run_again_request_by_request(target, tokenizer):
    eng = engine(target, tokenizer, invariant(target, "q4"), "off")
    prompts = random_prompts(len(tokenizer), 3, seed=13)
    alone = [run(eng, p)[0] for p in prompts]

    def broken(steps):
        raise RuntimeError("shared forward broke")

    eng.runner.forward_many = broken
    assert step_together(eng, prompts) == alone
