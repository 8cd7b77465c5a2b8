"""`WS /telephony/twilio`: a phone call through Twilio Media Streams, on the same pipeline.

Inbound messages are checked by MediaStreamSocket; pipecat's TwilioFrameSerializer does the
μ-law 8 kHz codec, sends the bot's audio as `media` and a `clear` on barge-in. We add a `mark`
after each bot utterance, so Twilio's echo tells us what the caller actually heard, and send the
`clear` only while the bot's audio is playing or queued at Twilio (LineSerializer).

Without Twilio credentials nothing calls Twilio's REST API: the call ends by closing the socket,
after which Twilio runs the next TwiML verb (none: it hangs up).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import APIRouter, WebSocket
from fastapi.responses import JSONResponse
from loguru import logger
from pipecat.frames.frames import (
    AudioRawFrame,
    Frame,
    InterruptionFrame,
    OutputTransportMessageFrame,
    TTSStoppedFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.serializers.twilio import TwilioFrameSerializer
from pipecat.transports.websocket.fastapi import (
    FastAPIWebsocketParams,
    FastAPIWebsocketTransport,
)

from voiceagent.pipeline.builder import build_call
from voiceagent.pipeline.watchdog import CallWatchdog
from voiceagent.server.auth import authorized, is_public, presented_token, twilio_signature_ok
from voiceagent.server.calls import DRAINING, ServerBusy
from voiceagent.server.media_streams import MediaStreamSocket, ProtocolViolation, StreamStart
from voiceagent.server.state import ServerState

PIPELINE_IN_RATE = 16000  # VAD and Whisper run at 16 kHz; the serializer upsamples 8 kHz
TWILIO_RATE = 8000  # TTS resamples straight to the line rate

router = APIRouter()


class LineSerializer(TwilioFrameSerializer):
    """pipecat's Twilio serializer, but a barge-in's `clear` goes out only while the bot's audio is
    playing or queued at Twilio: media sent after our last `mark`, or a mark Twilio has not yet
    echoed (it echoes one when the audio before it has played, and at once those a `clear`
    drops). An interruption in a silent line (the caller's first words, or words while the
    reply is still being generated) sends nothing."""

    def __init__(self, *args, marks_heard: Callable[[], int], **kwargs):
        super().__init__(*args, **kwargs)
        self._marks_heard = marks_heard  # marks Twilio has echoed so far
        self._marks_sent = 0
        self._marks_settled = 0  # marks sent before our last `clear`: no longer playing
        self._media_unmarked = False
        self.clears = 0

    @property
    def playing(self) -> bool:
        heard = max(self._marks_heard(), self._marks_settled)
        return self._media_unmarked or heard < self._marks_sent

    async def serialize(self, frame: Frame) -> str | bytes | None:
        if isinstance(frame, InterruptionFrame):
            if not self.playing:
                return None
            self.clears += 1
            self._marks_settled, self._media_unmarked = self._marks_sent, False
            return await super().serialize(frame)
        payload = await super().serialize(frame)
        if payload and isinstance(frame, AudioRawFrame):
            self._media_unmarked = True
        elif payload and isinstance(frame, OutputTransportMessageFrame) and (
                frame.message.get("event") == "mark"):
            self._marks_sent += 1
            self._media_unmarked = False
        return payload


class UtteranceMarks(FrameProcessor):
    """Frames in: everything, passed on. After each TTSStoppedFrame (the end of one utterance's
    audio) also an OutputTransportMessageFrame with a Twilio `mark`: the output transport sends
    it in order after that audio, and Twilio echoes it once the caller has heard it all."""

    def __init__(self, stream_sid: str, **kwargs):
        super().__init__(**kwargs)
        self._stream_sid = stream_sid
        self.sent = 0

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        if isinstance(frame, TTSStoppedFrame) and direction == FrameDirection.DOWNSTREAM:
            self.sent += 1
            mark = {"event": "mark", "streamSid": self._stream_sid,
                    "mark": {"name": f"bot-{self.sent}"}}
            await self.push_frame(OutputTransportMessageFrame(message=mark))


@router.websocket("/telephony/twilio")
async def twilio_stream(ws: WebSocket) -> None:
    server: ServerState = ws.app.state.server
    limits = server.cfg.server
    if server.calls.draining:  # refused before the upgrade: a balancer tries the next process
        await _deny(ws, 503, DRAINING)
        return
    await ws.accept()
    errors = server.metrics.errors
    sock = MediaStreamSocket(ws, limits,
                             on_refused=lambda code: errors.labels(f"ws_close_{code}").inc())
    if needs_twilio_auth(limits):
        await sock.close(1008, "Twilio calls to a public server need server.twilio_auth_token")
        return
    if not twilio_signature_ok(ws, limits.twilio_auth_token, limits.public_url):
        await sock.close(1008, "invalid Twilio signature")
        return
    early = presented_token(ws)  # a header token can be refused before `start`
    if early is not None and not authorized(ws, limits.token):
        await sock.close(1008, "unauthorized: missing or wrong token")
        return
    # Sockets that have not yet said who they are: bounded per client, in all, and in time.
    client = ws.client.host if ws.client else "-"
    if server.handshakes.get(client, 0) >= limits.max_handshakes_per_client:
        await sock.close(1013, "too many connections from this client waiting to start")
        return
    if sum(server.handshakes.values()) >= 4 * limits.max_calls:
        await sock.close(1013, "server busy: too many connections waiting to start")
        return
    timeout_s = min(limits.start_timeout_s, limits.idle_timeout_s)
    server.handshakes[client] = server.handshakes.get(client, 0) + 1
    try:
        start = await asyncio.wait_for(sock.handshake(), timeout_s)
    except ProtocolViolation as v:
        await sock.close(v.code, v.reason)
        return
    except TimeoutError:
        await sock.close(1008, f"no start within {timeout_s:g} s")
        return
    finally:
        server.handshakes[client] -= 1
        if not server.handshakes[client]:
            del server.handshakes[client]
    if not authorized(ws, limits.token, start.custom_parameters.get("token")):
        await sock.close(1008, "unauthorized: missing or wrong token")
        return
    if not server.ready:
        await sock.close(1013, "models still loading, try again shortly")
        return
    try:
        call = server.calls.reserve("twilio", start.call_sid)
        call.method = server.call_method()
    except ServerBusy as exc:
        await sock.close(1013, str(exc))
        return
    try:
        await _run_call(server, sock, start, call)
    finally:
        server.calls.release(call)
        await sock.close(1000, "call ended")


def needs_twilio_auth(limits) -> bool:
    """A public server refuses unsigned Twilio calls unless the operator allowed them."""
    return (is_public(limits) and not limits.twilio_auth_token
            and not limits.allow_public_without_token)


async def _run_call(server: ServerState, sock: MediaStreamSocket, start: StreamStart, call):
    serializer = LineSerializer(
        start.stream_sid,
        start.call_sid,
        params=TwilioFrameSerializer.InputParams(auto_hang_up=False, sample_rate=PIPELINE_IN_RATE),
        marks_heard=lambda: sock.marks_played,
    )
    transport = FastAPIWebsocketTransport(
        sock,  # the checked socket stands in for the WebSocket
        FastAPIWebsocketParams(
            audio_in_enabled=True,
            audio_out_enabled=True,
            audio_in_sample_rate=PIPELINE_IN_RATE,
            audio_out_sample_rate=TWILIO_RATE,
            serializer=serializer,
        ),
    )
    limits = server.cfg.server

    async def end(code: int, reason: str) -> None:
        # The pipeline first: closing waits (boundedly) for a peer that may never read again.
        sock.will_close(code, reason)
        await pipeline.task.cancel()
        await sock.close(code, reason)

    sock.on_stalled = lambda: server.calls.spawn(
        end(1011, f"peer not reading: nothing sent for {limits.send_timeout_s:g} s"))
    marks = UtteranceMarks(start.stream_sid)
    watchdog = CallWatchdog(limits.idle_timeout_s, limits.max_call_s,
                            lambda reason: server.calls.spawn(end(1000, reason)))
    pipeline = build_call(
        server.cfg, server.shared, transport, server.records.add, call_id=call.call_id,
        method=call.method, after_input=[watchdog],
        before_output=[marks],
    )
    @transport.event_handler("on_client_disconnected")
    async def _gone(_transport, _ws):
        await pipeline.task.cancel()

    logger.info(f"twilio call {call.call_id}: stream {start.stream_sid}, call {start.call_sid}")
    await server.calls.run(call, pipeline.task, pipeline.clocks.flush)
    logger.info(
        f"twilio call {call.call_id}: {marks.sent} utterance(s) sent, "
        f"{sock.marks_played} heard to the end, {serializer.clears} cleared by a barge-in"
    )


async def _deny(ws: WebSocket, status: int, reason: str) -> None:
    """Answer the upgrade request with an HTTP error instead of a WebSocket (nginx's
    `proxy_next_upstream http_503` then takes the call to another process); a server without the
    denial extension gets the WebSocket closed with 1013 instead."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(
            JSONResponse({"error": reason}, status, headers={"Retry-After": "5"}))
    else:
        await ws.accept()
        await ws.close(1013, reason)
