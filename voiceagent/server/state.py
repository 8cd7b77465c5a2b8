"""What one `serve` process holds: config, the shared models once loaded, calls, turn records,
and what the dashboard reads (the turn store, metrics, live events)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipecat.transports.smallwebrtc.request_handler import SmallWebRTCRequestHandler

from voiceagent.config import Config, config_hash
from voiceagent.dashboard.events import EventHub
from voiceagent.dashboard.metrics import TurnMetrics
from voiceagent.dashboard.store import TurnStore, open_store
from voiceagent.llm_setup import resident_bytes
from voiceagent.pipeline.builder import SharedModels
from voiceagent.pipeline.records import CallInfo, TurnRecords
from voiceagent.pipeline.telemetry import telemetry_sink
from voiceagent.server.ab import OffHoldout
from voiceagent.server.admission import Admission
from voiceagent.server.calls import ActiveCall, CallRegistry
from voiceagent.server.sessions import Sessions


@dataclass
class ServerState:
    cfg: Config
    calls: CallRegistry
    store: TurnStore
    events: EventHub
    metrics: TurnMetrics
    records: TurnRecords
    shared: SharedModels | None = None
    load_error: str | None = None
    loading_step: str = "starting"
    loader: threading.Thread | None = None  # the model load, while it runs
    webrtc: SmallWebRTCRequestHandler = field(default_factory=SmallWebRTCRequestHandler)
    webrtc_calls: dict[str, ActiveCall] = field(default_factory=dict)  # by pc_id
    handshakes: dict[str, int] = field(default_factory=dict)  # Twilio sockets before `start`,
    # by client address
    stopped: bool = False  # lifespan shutdown has run
    api_handles: set = field(default_factory=set)  # /v1 requests in flight
    holdout: OffHoldout | None = None  # the A/B baseline (server.ab_off_share)
    admission: Admission | None = None  # new calls by measured load (`server.admit_clock3_ms`)
    sessions: Sessions | None = None  # the pages' sign-in (`server.session_ttl_s`)
    # How a drain stops the process once its calls are over (`serve` sets it); None: it stays up.
    request_exit: Callable[[], None] | None = None
    drain_task: asyncio.Task | None = None

    def __post_init__(self) -> None:
        if self.holdout is None:
            self.holdout = OffHoldout(self.cfg.server.ab_off_share)
        if self.sessions is None:
            server = self.cfg.server
            self.sessions = Sessions(server.session_ttl_s, server.session_attempts_per_min)

    @property
    def ready(self) -> bool:
        return self.shared is not None

    @property
    def engine_down(self) -> str | None:
        """Why the LLM engine's worker thread no longer runs; None while it does (or loads)."""
        engine = self.shared.worker if self.shared else None
        if engine is None or engine.worker_alive:
            return None
        return engine.worker_error or "LLM engine worker stopped"

    def start_drain(self) -> None:
        """Refuse new calls, let those in progress finish (up to `server.drain_timeout_s`), then
        stop the process (`request_exit`). Call on the event loop; a second call changes
        nothing."""
        if self.drain_task is None:
            self.calls.draining = True  # from this moment, not from the task's first step
            self.drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        await self.calls.drain(self.cfg.server.drain_timeout_s)
        if self.request_exit is not None:
            self.request_exit()

    def call_method(self) -> str:
        """The speculation method of the next call: the configured one, or off for a call held
        out as the A/B baseline (the in-process engine only: a remote server speculates, or
        not, on its own)."""
        method = self.cfg.engine.speculation.method
        in_process = self.shared is not None and self.shared.worker is not None
        if in_process and method != "off" and self.holdout.next_is_off():
            return "off"
        return method

    def on_call(self, event: str, call: ActiveCall) -> None:
        """CallRegistry listener: calls into the store and the live events; failures counted."""
        if event == "failed":
            self.metrics.errors.labels("call_failed").inc()
            return
        ended_at = time.time() if event == "ended" else None
        llm = self.shared.llm if self.shared else None
        method = self.shared.chat.name if self.shared else self.cfg.engine.speculation.method
        if self.shared is not None and self.shared.worker is not None and call.method:
            method = call.method  # the in-process engine runs the method chosen for the call
        info = CallInfo(call.call_id, call.kind, call.started, method, config_hash(self.cfg),
                        llm.card.card_hash if llm else None, ended_at, call.call_sid)
        if event == "started":
            self.store.start_call(info)
        else:
            self.store.end_call(call.call_id, ended_at)
        self.events.publish("call", {"call_id": info.call_id, "kind": info.kind,
                                     "started_at": info.started_at, "ended_at": ended_at,
                                     "method": info.method, "call_sid": info.call_sid})


def new_state(cfg: Config, shared: SharedModels | None) -> ServerState:
    admission = Admission(cfg.server.admit_clock3_ms, lambda: len(calls.active))
    calls = CallRegistry(cfg.server.max_calls, admission.refusal)
    events = EventHub(cfg.store.transcripts, cfg.server.max_event_subscribers)

    def resident() -> float:
        llm = state.shared.llm if state.shared else None
        return float(resident_bytes(llm.target, llm.draft, llm.eagle)) if llm else 0.0

    def worker_up() -> float:
        return float(state.shared is not None and state.engine_down is None)

    metrics = TurnMetrics(active_calls=lambda: len(calls.active), resident_bytes=resident,
                          engine_worker_up=worker_up)
    metrics.watch_admission(lambda: admission.predicted_p95_ms(len(calls.active) + 1))
    store = open_store(cfg, on_error=lambda _error: metrics.errors.labels("store_write").inc())
    metrics.watch_store(store.health)
    def engine():
        return state.shared.worker if state.shared else None

    metrics.watch_engine(lambda: engine().in_flight if engine() else 0,
                         lambda: engine().restarts_done if engine() else 0)
    state = ServerState(cfg, calls, store, events, metrics,
                        TurnRecords([store, events, metrics, admission,
                                     *filter(None, [telemetry_sink(cfg)])]), shared=shared,
                        admission=admission)
    calls.listeners.append(state.on_call)
    return state
