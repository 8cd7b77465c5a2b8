"""The real engine with scripted trouble, for the LLM service's tests on tiny random models."""

from __future__ import annotations

import time

from llm_engine.engine import SpeculativeEngine
from llm_engine.serving import EngineWorker

HOLD_AFTER_STEPS = 3


class ScriptedEngine(SpeculativeEngine):
    """The real engine, with scripted trouble for the first request only.

    `hold_first`: after a few decode steps the first request waits, between two steps, until it
    is cancelled: a reply that is certainly still streaming when the interruption arrives,
    however fast or loaded the CPU is. `fail_first`: its first step (the prefill) raises.
    """

    def __init__(self, *args, hold_first: bool = False, fail_first: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.hold_first = hold_first
        self.fail_first = fail_first
        self.first = None
        self.dropped_sessions: list[str] = []

    def start(self, *args, **kwargs):
        state = super().start(*args, **kwargs)
        if self.first is None:
            self.first = state
        return state

    def step(self, state):
        if state is self.first and self.fail_first:
            raise RuntimeError("scripted failure")
        if state is self.first and self.hold_first and len(state.stats.steps) >= HOLD_AFTER_STEPS:
            deadline = time.monotonic() + 30  # a service that never cancels fails, not hangs
            while not state.cancelled and time.monotonic() < deadline:
                time.sleep(0.002)
        return super().step(state)

    def drop_session(self, session_id):
        self.dropped_sessions.append(session_id)
        super().drop_session(session_id)


class RecordingAsyncEngine(EngineWorker):
    """Keeps every handle, so a test can ask the engine how each request ended."""

    def __init__(self, engine):
        super().__init__(engine)
        self.handles = []

    def submit(self, *args, **kwargs):
        handle = super().submit(*args, **kwargs)
        self.handles.append(handle)
        return handle
