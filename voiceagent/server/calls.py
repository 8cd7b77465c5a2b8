"""Admission and lifetime of the calls one `serve` process runs at once.

A slot is reserved before a call's pipeline is built, so one call over `max_calls` is refused
before it costs anything, and the calls already running are untouched. Every call runs in its own
pipecat WorkerRunner on the server's event loop; the engine behind them is shared.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

from loguru import logger
from pipecat.pipeline.worker import PipelineWorker
from pipecat.workers.runner import WorkerRunner

DRAINING = "server draining: this process is stopping, try again (another process may answer)"


class ServerBusy(Exception):
    """All call slots are taken, or the process is draining; the message says so in words a
    caller's client can show."""


@dataclass
class ActiveCall:
    call_id: str
    kind: str  # "webrtc" | "twilio"
    call_sid: str | None = None  # Twilio's CallSid: what the operator finds the call by there
    method: str | None = None  # its speculation method (ServerState.call_method)
    started: float = field(default_factory=time.time)
    task: PipelineWorker | None = None
    runner: asyncio.Task | None = None


class CallRegistry:
    def __init__(self, max_calls: int, admission: Callable[[int], str | None] | None = None):
        """admission(calls in progress): why a new call must wait, or None (`admission.py`)."""
        self.max_calls = max_calls
        self.admission = admission
        self.active: dict[str, ActiveCall] = {}
        self.draining = False  # new calls refused; the ones in progress go on (`drain`)
        self._background: set[asyncio.Task] = set()
        # Called with ("started" | "ended" | "failed", call): the store, metrics, live events.
        self.listeners: list[Callable[[str, ActiveCall], None]] = []

    def _tell(self, event: str, call: ActiveCall) -> None:
        for listener in self.listeners:  # the store, metrics, events: each on its own
            try:
                listener(event, call)
            except Exception:
                logger.exception(f"call {call.call_id}: a '{event}' listener failed")

    def reserve(self, kind: str, call_sid: str | None = None) -> ActiveCall:
        if self.draining:
            raise ServerBusy(DRAINING)
        if len(self.active) >= self.max_calls:
            raise ServerBusy(
                f"server busy: {len(self.active)} of {self.max_calls} calls in progress, "
                "try again later"
            )
        if self.admission is not None and (why := self.admission(len(self.active))):
            raise ServerBusy(why)
        call = ActiveCall(uuid.uuid4().hex[:12], kind, call_sid)
        self.active[call.call_id] = call
        return call

    def release(self, call: ActiveCall) -> None:
        self.active.pop(call.call_id, None)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new calls from now on and wait, up to `timeout_s`, for the calls in progress
        to end. Returns how many still run (the shutdown that follows ends them)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        logger.info(f"draining: refusing new calls; {len(self.active)} in progress may finish "
                    f"within {timeout_s:g} s")
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.active:
            logger.warning(f"drain timed out: ending {len(self.active)} call(s) still running")
        else:
            logger.info("drained: no call in progress")
        return len(self.active)

    async def wait_idle(self, timeout_s: float = 30) -> None:
        """Until no call holds a slot (a caller that just hung up frees its slot only once its
        pipeline has ended): the next calls are not refused for the previous ones."""
        deadline = time.monotonic() + timeout_s
        while self.active:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.active)} call(s) still hold a slot after "
                                   f"{timeout_s} s")
            await asyncio.sleep(0.05)

    def spawn(self, coro: Coroutine) -> None:
        """Run `coro` in the background, keeping a reference so it is not collected mid-run."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def run(self, call: ActiveCall, task: PipelineWorker,
                  flush: Callable[[], None] | None = None) -> None:
        """Run the call's pipeline until it ends; the slot is freed whatever happens. `flush`
        then records the turn still in progress (the caller hung up during an answer)."""
        call.task = task
        call.runner = asyncio.current_task()
        logger.info(f"call {call.call_id} ({call.kind}) started; {len(self.active)} active")
        self._tell("started", call)
        try:
            runner = WorkerRunner(handle_sigint=False)
            await runner.add_workers(task)
            await runner.run()
        except Exception:
            logger.exception(f"call {call.call_id} failed")
            self._tell("failed", call)
        finally:
            self.release(call)
            if flush is not None:
                try:
                    flush()
                except Exception:
                    logger.exception(f"call {call.call_id}: recording its last turn failed")
            self._tell("ended", call)
            elapsed = time.time() - call.started
            logger.info(f"call {call.call_id} ended after {elapsed:.1f} s")

    async def end_all(self, grace_s: float = 3.0) -> None:
        """Shutdown: stop every pipeline still running (each transport then closes its peer)."""
        calls = list(self.active.values())
        for call in calls:
            if call.task is not None:
                await call.task.cancel()
        runners = [c.runner for c in calls if c.runner is not None and not c.runner.done()]
        if runners:
            await asyncio.wait(runners, timeout=grace_s)
