"""The async bridge: one worker thread steps every in-flight request; asyncio gets text deltas.

Sync torch, async pipeline, one bridge. The event loop never touches torch: it
submits a request and awaits `TextDelta`s that the worker hands over with
`loop.call_soon_threadsafe`.

Scheduling: requests are admitted in arrival order, and each round the worker gives every active
request one engine step (`SpeculativeEngine.step_many`): a prefill chunk alone, and every
request's decode or verify rows together in one target forward where the runner shares forwards
(the lean runner, up to its probed row count; each request keeps its own cache, and its tokens
are the ones it would get alone). Two callers then cost much less than two forwards: the weights
are read once for both. A new call's prefill waits at most one round, and a long reply cannot
starve anyone. A GPU deployment that needs many calls per device should move generation to
vLLM/SGLang behind the same interface.

Cancellation (barge-in): `RequestHandle.cancel()`, or cancelling the task that awaits the handle,
sets the request's flag; the worker honours it at the next step boundary, frees the KV, and
records cancel-to-stop time in the request's stats. A stop string or a failed step ends the
request through the same cancel, recorded as 'stop' or 'error', not as a caller's cancel.

A dead worker (an exception that escaped every request's guard) is not silent: it fails every
request it held, `submit` raises, and `worker_alive` / `worker_error` say so to health checks. A
caller gets an error at once instead of waiting for tokens that never come. With `restarts`, the
worker then serves again after a backoff (0.5 s, doubling), up to `restarts` times in
`RESTART_WINDOW_S`; `restarts_done` and `last_death` tell health checks it happened.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from llm_engine.config import SamplingConfig
from llm_engine.detok import IncrementalDetokenizer, StopMatcher
from llm_engine.engine import RequestState, SpeculativeEngine
from llm_engine.grammar import ToolCallSplitter
from llm_engine.stats import FinishReason, RequestStats

log = logging.getLogger(__name__)


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]
    t: float  # perf_counter when the step that committed these tokens ended


@dataclass
class Completion:
    text: str  # everything emitted (stop strings excluded)
    token_ids: list[int]  # every token the engine committed
    finish_reason: FinishReason
    stats: RequestStats
    error: str | None = None
    # A 'tools' request's call ({"name", "arguments"}), parsed out of `text`, which then holds
    # only what came before it (`llm_engine.grammar.ToolCallSplitter`).
    tool_calls: list[dict] = field(default_factory=list)


_DONE = object()


class DeltaStream:
    """A request's text deltas, then its `Completion`: iterate it, or await `result()`; either
    await, cancelled, cancels the request. Subclasses produce into `_queue` (deltas, then
    `END`) and `_completion`, and say how to `cancel()`."""

    END = _DONE

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._completion: asyncio.Future = loop.create_future()
        self._drained = False  # the end marker was consumed; iteration is over for good

    def cancel(self) -> None:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        return self._completion.done()

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> TextDelta:
        if self._drained:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel()  # the awaiting task was cancelled: stop the engine work too
            raise
        if item is _DONE:
            self._drained = True
            raise StopAsyncIteration
        return item

    async def result(self) -> Completion:
        """Wait for the end (draining the deltas); cancelling this await cancels the request."""
        try:
            async for _ in self:
                pass
            return await asyncio.shield(self._completion)
        except asyncio.CancelledError:
            self.cancel()
            raise


def _superseded(active: Collection[RequestHandle]) -> list[RequestHandle]:
    """Prefills (`submit(prefill=True)`) not begun whose prompt a later live request of their
    session starts with (the caller's words prefilled at the interim that also starts the
    prepared reply): that request prefills the same tokens in its own forward, so theirs would
    only delay it."""
    out = []
    for i, handle in enumerate(active):
        st = handle.state
        if not handle.prefill or st.session_id is None or st.cache is not None:
            continue
        prompt, n = st.prompt_ids, len(st.prompt_ids)
        if any(later.state.session_id == st.session_id and not later.state.cancelled
               and later.state.prompt_ids[:n] == prompt
               for later in itertools.islice(active, i + 1, None)):
            out.append(handle)
    return out


def _this_round(going: list[RequestHandle]) -> list[RequestHandle]:
    """The requests to step this round, in arrival order. One not begun waits while an earlier
    request of its session ends in this round (a one-token prefill of the system prompt or of
    the caller's words so far): its KV is the session's again at the end of the round, so the
    new request prefills only what follows instead of its whole prompt beside it."""
    ending: set[str] = set()
    ready = []
    for handle in going:
        st = handle.state
        if st.prefilled or st.session_id not in ending:
            ready.append(handle)
        generated = len(st.token_ids) - len(st.prompt_ids)  # not output_ids: no copy a round
        if st.session_id is not None and st.sampling.max_new_tokens - generated <= 1:
            ending.add(st.session_id)
    return ready


class RequestHandle(DeltaStream):
    """An in-flight engine request: iterate it for text deltas, `cancel()` it, or await
    `result()`."""

    def __init__(self, state: RequestState, loop: asyncio.AbstractEventLoop, tokenizer):
        super().__init__(loop)
        self.state = state
        self._loop = loop
        self._detok = IncrementalDetokenizer(tokenizer, state.prompt_ids)
        self._stops = StopMatcher(state.sampling.stop)
        self._text: list[str] = []
        self.stopped_by_string = False
        grammar = state.sampling.grammar
        tools = grammar is not None and grammar.kind == "tools"
        self._calls = ToolCallSplitter() if tools else None
        self.number = 0  # its place in the worker's submissions (`EngineWorker.hold_session`)
        self.prefill = False  # it only leaves its prompt in the session's cache (`submit`)

    def cancel(self) -> None:
        """Stop at the next step boundary. Safe from any thread, idempotent."""
        if not self.state.finished and not self.state.cancelled:
            self.state.cancel()

    # -- called on the worker thread -----------------------------------------------------------

    def _emit(self, tokens: list[int], t: float) -> bool:
        """Detokenise and hand over; True when a stop string ended the request."""
        text, stopped = self._stops.feed(self._detok.push(tokens))
        if stopped:
            self.stopped_by_string = True
        elif self.state.finished:
            tail, _ = self._stops.feed(self._detok.flush())
            text += tail + self._stops.flush()
        if self._calls is not None:
            text = self._calls.feed(text)
            if stopped or self.state.finished:
                text += self._calls.flush()
        if text or tokens:
            self._text.append(text)
            self._post(TextDelta(text, tokens, t))
        return stopped

    def _finish(self, reason: str, error: str | None = None) -> None:
        call = self._calls.call if self._calls is not None else None
        completion = Completion(
            "".join(self._text), list(self.state.output_ids), reason, self.state.stats, error,
            [call] if call is not None else [],
        )
        self._post(_DONE)
        self._post_result(completion)

    def _post(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.state.cancel()

    def _post_result(self, completion: Completion) -> None:
        def resolve() -> None:
            if not self._completion.done():
                self._completion.set_result(completion)

        try:
            self._loop.call_soon_threadsafe(resolve)
        except RuntimeError:
            pass


RESTART_WINDOW_S = 600.0  # a worker that died `restarts` times in this long stays down
RESTART_BACKOFF_S = 0.5  # before the first restart; doubling with each recent death
HOLD_POLL_S = 0.005  # a worker with only held requests looks at its inbox this often


class _Job:
    """A one-off call on the worker thread (not a request: no steps, no stats)."""

    def __init__(self, fn: Callable[[SpeculativeEngine], Any], loop: asyncio.AbstractEventLoop):
        self.fn, self.loop = fn, loop
        self.future: asyncio.Future = loop.create_future()

    def run(self, engine: SpeculativeEngine) -> None:
        if self.future.done():  # the caller stopped waiting: spare every call the forward
            return
        try:
            result = self.fn(engine)
        except BaseException as exc:  # the caller hears it; the worker serves on
            self.fail(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._post(result, None)

    def fail(self, exc: BaseException) -> None:
        self._post(None, exc)

    def _post(self, result: Any, exc: BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, exc)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class _CallJob(_Job):
    """A `_Job` for a caller on a thread without an event loop (`EngineWorker.call`)."""

    def __init__(self, fn: Callable[[SpeculativeEngine], Any]):
        self.fn, self.future = fn, concurrent.futures.Future()

    def _post(self, result: Any, exc: BaseException | None) -> None:
        if exc is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class EngineWorker:
    """Runs a `SpeculativeEngine` on its own worker thread for asyncio callers.

    `EngineWorker.build` loads the engine on that same thread. torch's CPU kernels run on an
    OpenMP team per calling thread, and once a second thread has its own team the two slow each
    other down: measured on 2 cores, a bf16 decode step took 37 ms when one thread did all the
    torch work and 50 ms when the models were loaded on another.
    """

    def __init__(self, engine: SpeculativeEngine | None, name: str = "llm-engine",
                 build: Callable[[], Any] | None = None, restarts: int = 0):
        self.engine = engine
        self.restarts = restarts  # how often a dead worker may serve again in RESTART_WINDOW_S
        self.restarts_done = 0
        self.last_death: str | None = None  # why the worker last died, restarted or not
        self._deaths: deque[float] = deque()
        self._inbox: queue.Queue[RequestHandle | _Job | None] = queue.Queue()
        self._closed = False
        self.in_flight = 0  # requests submitted and not yet ended
        self.replies_in_flight = 0  # ... of them, those that generate more than one token
        self._error: str | None = None  # why the worker died
        # Queueing a request and the worker's end exclude each other: nothing is queued after it.
        self._admit = threading.Lock()
        # Sessions whose requests wait while their caller's other work runs (`hold_session`):
        # session id -> (the event that ends the hold, its monotonic deadline, the count of
        # requests submitted before it: later ones are not held).
        self._holds: dict[str, tuple[threading.Event, float, int]] = {}
        self._submitted = 0
        # Other work that shares the cores (`share_cores`): (is it running, threads then,
        # threads otherwise); and the worker thread's torch threads as last set.
        self._sharing: tuple[Callable[[], bool], int, int] | None = None
        self._threads = 0
        self._built = threading.Event()
        self._build: tuple[Any, BaseException | None] = (None, None)
        self._thread = threading.Thread(target=self._run, args=(build,), name=name, daemon=True)
        self._thread.start()

    @classmethod
    def build(cls, build: Callable[[], Any], name: str = "llm-engine",
              restarts: int = 0) -> tuple[EngineWorker, Any]:
        """Run `build()` on a new worker thread, which then serves `build().engine`; returns the
        serving engine and what `build` returned. Raises what `build` raised."""
        serving = cls(None, name, build, restarts)
        serving._built.wait()
        built, error = serving._build
        if error is not None:
            raise error
        return serving, built

    @property
    def worker_alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    @property
    def worker_error(self) -> str | None:
        """What killed the worker thread; None while it runs (or after a clean close)."""
        return self._error

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig | None = None,
        session_id: str | None = None,
        method: str | None = None,
        prefill: bool = False,
    ) -> RequestHandle:
        """Queue a request; call from the event loop. `prefill`: it only leaves its prompt in
        the session's cache (one token), and a later request of the session that extends its
        prompt may take its place before it begins. Raises ValueError for a bad prompt, and
        RuntimeError once the engine is closed or its worker has died."""
        with self._admit:
            if self._closed or self._error is not None:
                raise RuntimeError(self._error or "engine is closed")
            state = self.engine.start(prompt_ids, sampling, session_id, method)
            handle = RequestHandle(state, asyncio.get_running_loop(), self.engine.tokenizer)
            self._submitted += 1
            handle.number = self._submitted
            handle.prefill = prefill
            self._inbox.put(handle)
            self.in_flight += 1
            self.replies_in_flight += _is_reply(state)
        return handle

    def hold_session(self, session_id: str, until: threading.Event, max_s: float) -> None:
        """Step none of `session_id`'s requests submitted so far (cancelled ones aside) until
        `until` is set, or for `max_s` at most: their caller has what it needs for now, and its
        next need goes faster with the cores (a voice reply's first phrase being synthesised,
        while the reply decodes what follows it). Later requests of the session (a turn's next
        prefill) and other sessions' requests step as before. Safe from any thread."""
        with self._admit:
            self._holds[session_id] = (until, time.monotonic() + max_s, self._submitted)

    def share_cores(self, busy: Callable[[], bool], threads: int, otherwise: int) -> None:
        """Step on `threads` CPU threads while `busy()` (other work on the cores, such as speech
        recognition, is running) and on `otherwise` when it is not; looked at before each round
        of steps. An OpenMP team waits for its slowest thread, and a thread that lost its core
        to the other work holds up every kernel of the step. The counts must give the same
        logits (`llm_engine.threads.identical_logits`): a token must not depend on timing."""
        self._sharing = (busy, threads, otherwise)

    def call(self, fn: Callable[[SpeculativeEngine], Any]) -> Any:
        """fn(engine) on the worker thread between two rounds of steps, for setup code on a
        thread without an event loop; blocks until it returns, and raises what it raised."""
        if threading.current_thread() is self._thread:  # queued, it would wait for itself
            return fn(self.engine)
        job = _CallJob(fn)
        with self._admit:
            if self._closed or self._error is not None:
                raise RuntimeError(self._error or "engine is closed")
            self._inbox.put(job)
        return job.future.result()

    async def generate(self, prompt_ids: list[int], **kwargs) -> Completion:
        return await self.submit(prompt_ids, **kwargs).result()

    async def next_logprob(self, prompt_ids: list[int], token_ids: Collection[int]) -> float:
        """`SpeculativeEngine.next_logprob` on the worker thread, between two rounds of steps.
        Raises what it raised, and RuntimeError once the engine is closed or its worker died."""
        loop = asyncio.get_running_loop()
        job = _Job(lambda engine: engine.next_logprob(prompt_ids, token_ids), loop)
        with self._admit:
            if self._closed or self._error is not None:
                raise RuntimeError(self._error or "engine is closed")
            self._inbox.put(job)
        return await job.future

    def close(self, timeout: float = 10.0) -> None:
        """Cancel whatever is in flight and stop the worker."""
        with self._admit:
            self._closed = True
            self._inbox.put(None)
        self._thread.join(timeout)

    # -- worker thread -------------------------------------------------------------------------

    def _run(self, build: Callable[[], Any] | None) -> None:
        if build is not None:
            try:
                built = build()
                self.engine = built.engine
                self._build = (built, None)
            except BaseException as exc:
                self._build, self._error = (None, exc), f"engine failed to load: {exc}"
                return
            finally:
                self._built.set()
        while True:
            active: deque[RequestHandle] = deque()
            try:
                self._serve(active)
                return
            except BaseException as exc:  # escaped every request's guard: fail loudly, never hang
                log.critical("LLM engine worker died", exc_info=exc)
                self.last_death = f"LLM engine worker died: {type(exc).__name__}: {exc}"
                self._fail_all(active, self.last_death)
            if not self._may_restart():
                return

    def _may_restart(self) -> bool:
        """After a death: wait out the backoff and serve again, unless the worker has died too
        often lately (or is being closed)."""
        now = time.monotonic()
        while self._deaths and self._deaths[0] < now - RESTART_WINDOW_S:
            self._deaths.popleft()
        if len(self._deaths) >= self.restarts:
            return False
        time.sleep(RESTART_BACKOFF_S * 2 ** len(self._deaths))
        self._deaths.append(now)
        with self._admit:
            if self._closed:
                return False
            self._error = None  # submit accepts requests again
            self.restarts_done += 1
        log.warning(f"LLM engine worker restarted ({self.restarts_done} so far): {self.last_death}")
        return True

    def _serve(self, active: deque[RequestHandle]) -> None:
        while True:
            try:
                while True:  # admit everything waiting; block only when idle
                    item = self._inbox.get(block=not active)
                    if item is None:
                        self._shutdown(active)
                        return
                    if isinstance(item, _Job):
                        self._fit_threads()
                        item.run(self.engine)
                        self._threads = 0  # a job may have set torch's threads itself
                    else:
                        active.append(item)
            except queue.Empty:
                pass
            # One step for every request, their decode rows in one forward where the runner
            # shares forwards; they stay in `active` while they step: a crash still fails them.
            # Cancelled requests end first, so that their KV is back in their session's cache
            # before a newer request of the same session prefills.
            for handle in _superseded(active):
                handle.state.cancel()
            cancelled = [handle for handle in active if handle.state.cancelled]
            going = _this_round([handle for handle in active if handle not in cancelled])
            held, until = self._held(going)
            if held:
                going = [handle for handle in going if handle not in held]
                if not going and not cancelled:
                    until.wait(HOLD_POLL_S)  # the inbox is looked at between waits
                    continue
            self._fit_threads()
            for handles in (cancelled, going):
                results = self.engine.step_many([handle.state for handle in handles])
                for handle, result in zip(handles, results, strict=True):
                    if not self._stepped(handle, result):
                        active.remove(handle)

    def _fit_threads(self) -> None:
        """torch's threads as `share_cores` asks for now (this thread's; cheap when unchanged)."""
        if self._sharing is None:
            return
        busy, threads, otherwise = self._sharing
        wanted = threads if busy() else otherwise
        if wanted != self._threads:
            torch.set_num_threads(wanted)
            self._threads = wanted

    def _held(self, going: list[RequestHandle]
              ) -> tuple[list[RequestHandle], threading.Event | None]:
        """The requests of `going` that a hold covers (`hold_session`), and the event that ends
        the first one's hold; holds that ended are forgotten."""
        if not self._holds:
            return [], None
        now = time.monotonic()
        with self._admit:
            for session, (until, deadline, _) in list(self._holds.items()):
                if until.is_set() or now >= deadline:
                    del self._holds[session]
            holds = dict(self._holds)
        held, first = [], None
        for handle in going:
            hold = holds.get(handle.state.session_id)
            if hold is not None and handle.number <= hold[2]:
                held.append(handle)
                first = first or hold[0]
        return held, first

    def _stepped(self, handle: RequestHandle, result: list[int] | Exception) -> bool:
        """Hand over one request's step (its tokens, or the exception it raised); False when the
        request is over."""
        st = handle.state
        try:
            if isinstance(result, Exception):
                raise result
            stopped = handle._emit(result, time.perf_counter()) if result else False
        except Exception as exc:  # one bad request must not take the worker down
            log.error("request failed", exc_info=exc)
            self._end(handle, "error", f"{type(exc).__name__}: {exc}")
            return False
        if stopped:
            self._end(handle, "stop")
            return False
        if st.finished:
            self._end(handle, st.finish_reason or "eos")
            return False
        return True

    def _end(self, handle: RequestHandle, reason: str, error: str | None = None) -> None:
        """Free the request and hand over its completion; the engine records `reason` unless it
        had already finished the request itself (EOS or length in the same step)."""
        st = handle.state
        if not st.finished:
            st.cancel(reason)  # release() finishes an unfinished request as its cancel says
        self.engine.release(st)
        if st.finish_reason == "cancelled" and st.cancel_time is not None:  # up to the KV freed
            st.stats.cancel_to_stop_ms = (time.perf_counter() - st.cancel_time) * 1000
        with self._admit:
            self.in_flight -= 1
            self.replies_in_flight -= _is_reply(st)
        handle._finish(st.finish_reason, error)

    def _shutdown(self, active: deque[RequestHandle]) -> None:
        for handle in active:
            self._end(handle, "cancelled")

    def _fail_all(self, active: deque[RequestHandle], error: str) -> None:
        """The worker is dying: end what it held and what waits in the inbox, as errors."""
        with self._admit:
            self._error = error
            waiting = [self._inbox.get_nowait() for _ in range(self._inbox.qsize())]
            self.in_flight = self.replies_in_flight = 0
        for handle in [*active, *waiting]:
            if handle is None:  # close() asked the worker to stop
                continue
            if isinstance(handle, _Job):
                handle.fail(RuntimeError(error))
                continue
            handle.state.cancel("error")
            try:
                self.engine.release(handle.state)
            except Exception:  # the engine may be what broke; the caller must hear either way
                log.exception("could not release a request of the dead worker")
            handle._finish("error", error)


def _is_reply(state) -> bool:
    """A request that generates, not a one-token prefill that leaves a prompt in the cache."""
    return state.sampling.max_new_tokens > 1
