"""One engine request run to its end, stepped by hand as the serving worker steps it."""

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
