"""What one `serve` process holds: config, the shared models once loaded, calls, turn records."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipecat.transports.smallwebrtc.request_handler import SmallWebRTCRequestHandler

from voiceagent.config import Config
from voiceagent.pipeline.builder import SharedModels
from voiceagent.pipeline.records import TurnRecords
from voiceagent.server.calls import ActiveCall, CallRegistry


@dataclass
class ServerState:
    cfg: Config
    calls: CallRegistry
    records: TurnRecords
    shared: SharedModels | None = None
    load_error: str | None = None
    loading_step: str = "starting"
    webrtc: SmallWebRTCRequestHandler = field(default_factory=SmallWebRTCRequestHandler)
    webrtc_calls: dict[str, ActiveCall] = field(default_factory=dict)  # by pc_id
    handshakes: int = 0  # Twilio sockets waiting for their `start`
    stopped: bool = False  # lifespan shutdown has run

    @property
    def ready(self) -> bool:
        return self.shared is not None
