"""One engine request run to its end, stepped by hand as the serving worker steps it; and a
speculative engine checked against plain decoding on the same runner."""

from __future__ import annotations


def run(engine, prompt, sampling=None, session_id=None, limit=None):
    """All tokens of one request, and its state; `limit(k)` replaces the gate's draft-length
    decision."""
    state = engine.start(prompt, sampling, session_id)
    if limit is not None:
        state.gate.limit = limit
    tokens = []
    while not state.finished:
        tokens += engine.step(state)
    engine.release(state)
    return tokens, state


def plain_and_speculative(target, tokenizer, runner, speculation, max_new_tokens, **proposer):
    """Two engines on one runner and cost model: plain decoding, and `speculation` with the
    `proposer` models it names (draft_model=..., eagle_head=...)."""
    from llm_engine.config import EngineConfig, SamplingConfig
    from llm_engine.engine import SpeculativeEngine

    sampling = SamplingConfig(max_new_tokens=max_new_tokens)
    off = SpeculativeEngine(target, tokenizer, EngineConfig(sampling=sampling, max_context=256),
                            runner=runner)
    spec = SpeculativeEngine(
        target, tokenizer,
        EngineConfig(sampling=sampling, max_context=256, speculation=speculation),
        runner=runner, cost_model=off.cost_model, **proposer)
    return off, spec


def accepted_with_equal_output(spec, off, prompts) -> int:
    """Asserts `spec` writes what `off` writes for every prompt; the drafts it accepted."""
    accepted = 0
    for prompt in prompts:
        got, state = run(spec, prompt)
        assert got == run(off, prompt)[0]
        accepted += state.stats.accepted
    return accepted
