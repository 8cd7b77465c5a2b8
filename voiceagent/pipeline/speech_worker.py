"""One thread per speech model for every call in the process, the most urgent work first.

Without it each call ran its Whisper passes and Piper chunks on threads of its own: with four
callers, four Whisper runs (each with its own CPU threads) and four syntheses fought over two
cores, and a caller's final transcript waited behind other callers' interims. Here one worker
thread runs a model's jobs one at a time, critical ones first (a final or pause transcript, a
reply's first phrase), then background ones (interims, later phrases), each in arrival order. A
job whose caller stopped waiting (cancelled) is dropped before it runs.

While any call's reply is on its way to its first audio (`Openings`), a background job waits, up
to the worker's `hold_s` from its submission: the cores go to that reply's first phrase (the
engine's decode, Piper's first chunk), the work clock 3 waits on. Under four callers on 2 cores a
background job beside it had doubled both.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

CRITICAL = 0  # on a caller's critical path: the transcript at a pause or a stop, a first phrase
BACKGROUND = 1  # interims, later phrases
HOLD_POLL_S = 0.005  # a held background job looks again this often (a critical one goes first)

T = TypeVar("T")


class Openings:
    """The replies of every call in the process that are on their way to their first audio:
    from the reply's start to its first phrase's first chunk (`open`, `close`; any hashable key,
    one per call). An opening left open (a frame lost) lapses after `lapse_s`. Safe from any
    thread."""

    def __init__(self, lapse_s: float = 1.5):
        self._lapse_s = lapse_s
        self._open: dict[object, float] = {}
        self._lock = threading.Lock()

    def open(self, reply: object) -> None:
        with self._lock:
            self._open[reply] = time.monotonic()

    def close(self, reply: object) -> None:
        with self._lock:
            self._open.pop(reply, None)

    def any(self) -> bool:
        now = time.monotonic()
        with self._lock:
            for reply, since in list(self._open.items()):
                if now - since >= self._lapse_s:
                    del self._open[reply]
            return bool(self._open)


class SpeechWorker:
    def __init__(self, name: str, openings: Openings | None = None, hold_s: float = 0.0):
        """openings, hold_s: a background job waits while a reply opens, `hold_s` at most."""
        self.name = name
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()  # arrival order within a priority
        self._openings, self._hold_s = openings, hold_s
        self._closed = False
        self._running = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any, priority: int = BACKGROUND) -> T:
        """fn(*args) on the worker thread, after every job queued before it at its priority or
        a more urgent one. Raises RuntimeError once the worker is closed."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._jobs.put((priority, next(self._order), time.monotonic(), fn, args, loop, done))
        return await done

    def busy(self) -> bool:
        """Whether a job is running now (safe from any thread)."""
        return self._running

    def close(self) -> None:
        """Stop after the job in progress; the jobs still queued fail with RuntimeError."""
        self._closed = True
        self._jobs.put((-1, next(self._order), 0.0, None, (), None, None))  # before anything
        self._thread.join(5)
        while not self._jobs.empty():
            *_, loop, done = self._jobs.get_nowait()
            if done is not None:  # not the stop marker of a worker still busy
                _post(loop, done, None, RuntimeError(f"{self.name} closed"))

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            priority, _, submitted, fn, args, loop, done = job
            if fn is None:
                return
            if done.cancelled():  # its caller hung up or moved on: the cores are better spent
                continue
            if self._holds(priority, submitted):
                self._jobs.put(job)
                time.sleep(HOLD_POLL_S)
                continue
            self._running = True
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # the caller's to handle; the worker serves the next
                result, error = None, exc
            finally:
                self._running = False
            _post(loop, done, result, error)

    def _holds(self, priority: int, submitted: float) -> bool:
        """Whether a background job waits longer: a reply is opening, and the job was submitted
        less than `hold_s` ago (jobs queued together wait together, not one after another)."""
        return priority == BACKGROUND and self._openings is not None \
            and time.monotonic() - submitted < self._hold_s and self._openings.any()


async def run_on(worker: SpeechWorker | None, fn: Callable[..., T], *args: Any,
                 priority: int = BACKGROUND) -> T:
    """fn(*args) on `worker`, or on a thread of its own without one (a service built alone)."""
    if worker is None:
        return await asyncio.to_thread(fn, *args)
    return await worker.run(fn, *args, priority=priority)


def _post(loop, done, result, error) -> None:
    try:
        loop.call_soon_threadsafe(_resolve, done, result, error)
    except RuntimeError:  # that caller's event loop has closed
        pass


def _resolve(done: asyncio.Future, result, error: BaseException | None) -> None:
    if done.cancelled():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)
