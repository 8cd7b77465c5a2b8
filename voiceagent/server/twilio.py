"""`WS /telephony/twilio`: a phone call through Twilio Media Streams, on the same pipeline.

Inbound messages are checked by MediaStreamSocket; pipecat's TwilioFrameSerializer does the
μ-law 8 kHz codec, sends the bot's audio as `media` and a `clear` on barge-in. We add a `mark`
after each bot utterance, so Twilio's echo tells us what the caller actually heard.

Without Twilio credentials nothing calls Twilio's REST API: the call ends by closing the socket,
after which Twilio runs the next TwiML verb (none: it hangs up).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, WebSocket
from loguru import logger
from pipecat.frames.frames import Frame, OutputTransportMessageFrame, TTSStoppedFrame
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.serializers.twilio import TwilioFrameSerializer
from pipecat.transports.websocket.fastapi import (
    FastAPIWebsocketParams,
    FastAPIWebsocketTransport,
)

from voiceagent.pipeline.builder import build_call
from voiceagent.pipeline.idle import IdleWatchdog
from voiceagent.server.auth import presented_token, token_ok, twilio_signature_ok
from voiceagent.server.calls import ServerBusy
from voiceagent.server.media_streams import MediaStreamSocket, ProtocolViolation, StreamStart
from voiceagent.server.state import ServerState

START_TIMEOUT_S = 10.0  # Twilio sends `start` right after connecting
PIPELINE_IN_RATE = 16000  # VAD and Whisper run at 16 kHz; the serializer upsamples 8 kHz
TWILIO_RATE = 8000  # TTS resamples straight to the line rate

router = APIRouter()


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
    await ws.accept()
    errors = server.metrics.errors
    sock = MediaStreamSocket(ws, limits.max_message_bytes,
                             on_refused=lambda code: errors.labels(f"ws_close_{code}").inc())
    if not twilio_signature_ok(ws, limits.twilio_auth_token, limits.public_url):
        await sock.close(1008, "invalid Twilio signature")
        return
    early = presented_token(ws)  # a header or query token can be refused before `start`
    if early is not None and not token_ok(limits.token, early):
        await sock.close(1008, "unauthorized: missing or wrong token")
        return
    # Sockets that have not yet said who they are: bounded in number and time.
    if server.handshakes >= 2 * limits.max_calls:
        await sock.close(1013, "server busy: too many connections waiting to start")
        return
    timeout_s = min(START_TIMEOUT_S, limits.idle_timeout_s)
    server.handshakes += 1
    try:
        start = await asyncio.wait_for(sock.handshake(), timeout_s)
    except ProtocolViolation as v:
        await sock.close(v.code, v.reason)
        return
    except asyncio.TimeoutError:
        await sock.close(1000, f"idle timeout: no start within {timeout_s:g} s")
        return
    finally:
        server.handshakes -= 1
    if not token_ok(limits.token, presented_token(ws, start.custom_parameters.get("token"))):
        await sock.close(1008, "unauthorized: missing or wrong token")
        return
    if not server.ready:
        await sock.close(1013, "models still loading, try again shortly")
        return
    try:
        call = server.calls.reserve("twilio")
    except ServerBusy as exc:
        await sock.close(1013, str(exc))
        return
    try:
        await _run_call(server, sock, start, call)
    finally:
        server.calls.release(call)
        await sock.close(1000, "call ended")


async def _run_call(server: ServerState, sock: MediaStreamSocket, start: StreamStart, call):
    serializer = TwilioFrameSerializer(
        start.stream_sid,
        start.call_sid,
        params=TwilioFrameSerializer.InputParams(auto_hang_up=False, sample_rate=PIPELINE_IN_RATE),
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
    timeout_s = server.cfg.server.idle_timeout_s

    async def end(code: int, reason: str) -> None:
        await sock.close(code, reason)
        await pipeline.task.cancel()

    def on_idle() -> None:
        server.calls.spawn(end(1000, f"idle timeout: no audio for {timeout_s:g} s"))

    marks = UtteranceMarks(start.stream_sid)
    pipeline = build_call(
        server.cfg, server.shared, transport, server.records.add, call_id=call.call_id,
        after_input=[IdleWatchdog(timeout_s, on_idle)], before_output=[marks],
    )
    @transport.event_handler("on_client_disconnected")
    async def _gone(_transport, _ws):
        await pipeline.task.cancel()

    logger.info(f"twilio call {call.call_id}: stream {start.stream_sid}, call {start.call_sid}")
    await server.calls.run(call, pipeline.task)
    pipeline.clocks.flush()
    logger.info(
        f"twilio call {call.call_id}: {marks.sent} utterance(s) sent, "
        f"{sock.marks_played} heard to the end"
    )
