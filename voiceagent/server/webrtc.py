"""Browser calls: SmallWebRTC signalling on `POST /api/offer` (new call or renegotiation) and
`PATCH /api/offer` (trickled ICE candidates), and the call's pipeline on pipecat's
SmallWebRTCTransport. The page talks RTVI over the data channel: pipecat's RTVI observer sends the
live transcript and the bot's words; after each turn we add its clocks, speculation figures and
tool calls as an RTVI server message, and before the server ends a call, why.

`GET /api/ice` gives the page the STUN/TURN servers (`server.ice_servers`) for its
RTCPeerConnection, behind the same token as the offer (a TURN server's credential is in it); the
server's own peer connections use the same list.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from aiortc.mediastreams import MediaStreamError
from fastapi import APIRouter, HTTPException, Request
from loguru import logger
from pipecat.processors.frameworks.rtvi import RTVIServerMessageFrame
from pipecat.transports.base_transport import TransportParams
from pipecat.transports.smallwebrtc.connection import (
    AUDIO_TRANSCEIVER_INDEX,
    IceServer,
    SmallWebRTCConnection,
    SmallWebRTCTrack,
)
from pipecat.transports.smallwebrtc.request_handler import (
    IceCandidate,
    SmallWebRTCPatchRequest,
    SmallWebRTCRequest,
)
from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport

from voiceagent.dashboard.stats import turn_speculation
from voiceagent.pipeline.builder import build_call
from voiceagent.pipeline.turn_record import TurnRecord
from voiceagent.pipeline.watchdog import CallWatchdog
from voiceagent.server.auth import authorized
from voiceagent.server.calls import ActiveCall, ServerBusy
from voiceagent.server.guard import json_object
from voiceagent.server.state import ServerState

IN_RATE = 16000  # VAD and Whisper's rate; the transport resamples the browser's 48 kHz
OUT_RATE = 24000
END_NOTICE_S = 0.5  # the page's "the server ended the call: why" goes out before the end

router = APIRouter()


async def _checked_body(request: Request, server: ServerState) -> dict:
    if not authorized(request, server.cfg.server.token):
        raise HTTPException(401, "unauthorized: missing or wrong token")
    return await json_object(request, server.cfg.server.max_message_bytes)


def ice_servers(cfg) -> list[dict]:
    """`server.ice_servers` as the browser's RTCIceServer dicts: {urls, username?, credential?}."""
    out = []
    for entry in cfg.server.ice_servers:
        urls = [entry.urls] if isinstance(entry.urls, str) else list(entry.urls)
        if not urls:
            continue
        server = {"urls": urls}
        for key in ("username", "credential"):
            if getattr(entry, key):
                server[key] = getattr(entry, key)
        out.append(server)
    return out


def _aiortc_ice_servers(servers: list[dict]) -> list[IceServer]:
    return [IceServer(urls=s["urls"], username=s.get("username"),
                      credential=s.get("credential")) for s in servers]


@router.get("/api/ice")
async def ice(request: Request):
    """The page's ICE servers; [] when none are configured (host candidates: same network)."""
    server: ServerState = request.app.state.server
    if not authorized(request, server.cfg.server.token):
        raise HTTPException(401, "unauthorized: missing or wrong token")
    return {"ice_servers": ice_servers(server.cfg)}


@router.post("/api/offer")
async def offer(request: Request):
    server: ServerState = request.app.state.server
    data = await _checked_body(request, server)
    try:
        req = SmallWebRTCRequest.from_dict(data)
    except TypeError as exc:
        raise HTTPException(400, f"bad offer: {exc}") from None
    if not isinstance(req.sdp, str) or req.type != "offer":
        raise HTTPException(400, "bad offer: need 'sdp' (a string) and type 'offer'")
    for name, kind in (("pc_id", str), ("restart_pc", bool)):
        if getattr(req, name) is not None and not isinstance(getattr(req, name), kind):
            raise HTTPException(400, f"bad offer: '{name}' must be a {kind.__name__}")
    if req.pc_id in server.webrtc_calls:  # renegotiation of a call in progress
        return await _renegotiate(server, req)
    if not server.ready:
        raise HTTPException(503, "models still loading, try again shortly",
                            headers={"Retry-After": "5"})
    try:
        call = server.calls.reserve("webrtc")
        call.method = server.call_method()
    except ServerBusy as exc:
        raise HTTPException(503, str(exc), headers={"Retry-After": "10"}) from None

    connections: list[SmallWebRTCConnection] = []
    # The server's side gathers its candidates with the same STUN/TURN servers as the page.
    server.webrtc.update_ice_servers(_aiortc_ice_servers(ice_servers(server.cfg)))

    async def start(connection: SmallWebRTCConnection) -> None:
        connections.append(connection)
        _start_call(server, call, connection)

    try:
        answer = await server.webrtc.handle_web_request(req, start)
        if call.runner is None:  # building the pipeline failed: pipecat logged why
            raise RuntimeError("could not start the call")
    except Exception as exc:
        await _abandon(server, call, connections)
        raise HTTPException(400, f"bad offer: {exc}") from None
    pc_id = answer["pc_id"]
    server.webrtc_calls[pc_id] = call
    call.runner.add_done_callback(lambda _: server.webrtc_calls.pop(pc_id, None))
    return answer


@router.patch("/api/offer")
async def ice_candidates(request: Request):
    server: ServerState = request.app.state.server
    data = await _checked_body(request, server)
    if not isinstance(data.get("pc_id"), str):
        raise HTTPException(400, "bad candidates: need 'pc_id' (a string)")
    try:
        patch = SmallWebRTCPatchRequest(
            pc_id=data["pc_id"],
            candidates=[IceCandidate(**c) for c in data.get("candidates", [])],
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise HTTPException(400, f"bad candidates: {exc}") from None
    try:
        await server.webrtc.handle_patch_request(patch)
    except HTTPException:  # 404: an unknown pc_id
        raise
    except Exception as exc:  # aiortc's candidate parser on a malformed candidate line
        raise HTTPException(400, f"bad candidate: {exc}") from None
    return {"status": "ok"}


async def _renegotiate(server: ServerState, req: SmallWebRTCRequest) -> dict:
    call = server.webrtc_calls[req.pc_id]
    if call.runner is None or call.runner.done():
        raise HTTPException(409, "that call has ended; start a new one without pc_id")

    async def no_new_call(connection: SmallWebRTCConnection) -> None:
        await connection.disconnect()  # pipecat made a new connection: the old one had closed

    try:
        return await server.webrtc.handle_web_request(req, no_new_call)
    except Exception as exc:
        raise HTTPException(400, f"bad renegotiation offer: {exc}") from None


async def _abandon(server: ServerState, call: ActiveCall, connections: list) -> None:
    """Undo a call that failed to start: its pipeline, its peer connection and its slot."""
    if call.task is not None:
        await call.task.cancel()
    for connection in connections:
        await connection.disconnect()
    server.calls.release(call)


class CallerAudioTrack(SmallWebRTCTrack):
    """The caller's audio. When the peer hangs up (or vanishes), its DTLS transport closes and
    ends the track; pipecat's reader would report the next read as a media stream error. Here
    that read waits instead, until the call ends on the connection's close, which follows at once
    (pipecat's `on_client_disconnected`). A track that ends while its connection is up still
    raises, and is reported."""

    async def recv(self):
        try:
            return await super().recv()
        except MediaStreamError:
            if self._receiver.transport.state not in ("closed", "failed"):
                raise
            logger.debug("webrtc: the caller's audio ended with the connection")
            await asyncio.Future()  # cancelled with the call's pipeline


def _caller_audio(connection: SmallWebRTCConnection) -> None:
    """Put a CallerAudioTrack where pipecat looks for the caller's audio: its connection builds
    one track wrapper per transceiver when first asked (`audio_input_track`) and keeps it."""
    transceivers = connection.pc.getTransceivers()
    if transceivers and transceivers[AUDIO_TRANSCEIVER_INDEX].receiver:
        connection._track_map[AUDIO_TRANSCEIVER_INDEX] = CallerAudioTrack(
            transceivers[AUDIO_TRANSCEIVER_INDEX].receiver)


def _start_call(server: ServerState, call: ActiveCall, connection: SmallWebRTCConnection) -> None:
    _caller_audio(connection)
    transport = SmallWebRTCTransport(
        connection,
        TransportParams(audio_in_enabled=True, audio_out_enabled=True,
                        audio_in_sample_rate=IN_RATE, audio_out_sample_rate=OUT_RATE),
    )

    def on_turn(record: TurnRecord) -> None:
        server.records.add(record)
        message = RTVIServerMessageFrame(data=turn_message(record))
        server.calls.spawn(pipeline.task.queue_frame(message))

    def on_end(reason: str) -> None:
        logger.info(f"webrtc call {call.call_id}: {reason}")
        server.calls.spawn(end(reason))

    async def end(reason: str) -> None:
        """Tell the page why, then end the call."""
        await pipeline.task.queue_frame(
            RTVIServerMessageFrame(data={"type": "call-ended", "reason": reason}))
        await asyncio.sleep(END_NOTICE_S)
        await pipeline.task.cancel()

    limits = server.cfg.server
    pipeline = build_call(
        server.cfg, server.shared, transport, on_turn, call_id=call.call_id,
        method=call.method,
        after_input=[CallWatchdog(limits.idle_timeout_s, limits.max_call_s, on_end)], rtvi=True,
    )

    @transport.event_handler("on_client_disconnected")
    async def _gone(_transport, _connection):
        await pipeline.task.cancel()

    async def connected_or_ended() -> None:
        await asyncio.sleep(limits.connect_timeout_s)
        if not connection.is_connected() and not call.runner.done():
            logger.info(f"webrtc call {call.call_id}: the peer did not connect within "
                        f"{limits.connect_timeout_s:g} s; ending it")
            await pipeline.task.cancel()

    call.task = pipeline.task
    call.runner = asyncio.get_running_loop().create_task(
        server.calls.run(call, pipeline.task, pipeline.clocks.flush))
    server.calls.spawn(connected_or_ended())


def turn_message(record: TurnRecord) -> dict:
    """The RTVI server-message the call page shows after each turn: its words, clocks, the
    speculation that answered it (the dashboard's `turn_speculation`; None where the engine did
    not measure a figure, e.g. a remote LLM's), the barge-in's parts, and its tool calls."""
    engine = record.engine
    spec = turn_speculation(engine) if engine else {}
    return {
        "type": "turn",
        "turn": record.turn,
        "user_text": record.user_text,
        "bot_text": record.bot_text,
        "interrupted": record.interrupted,
        "clocks": asdict(record.clocks),
        "barge_in_to_silence_ms": record.barge_in_to_silence_ms,
        "barge_in_detection_ms": record.barge_in_detection_ms,
        "speculation": {
            "method": engine.method if engine else None,
            "accepted_per_step": spec.get("accepted_per_step"),
            "acceptance_rate": spec.get("acceptance_rate"),
            "tokens_per_s": engine.tokens_per_s if engine else None,
            "generated_tokens": engine.generated_tokens if engine else None,
        },
        "tool_calls": [{"name": c.name, "duration_ms": c.duration_ms, "ok": c.ok,
                        "outcome": c.outcome} for c in record.tool_calls],
    }
