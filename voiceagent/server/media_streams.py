"""Twilio Media Streams, inbound side: each message checked before pipecat's serializer sees it.

Protocol: https://www.twilio.com/docs/voice/media-streams/websocket-messages. Twilio sends
`connected`, then `start` (streamSid, callSid, customParameters, mediaFormat audio/x-mulaw
8000 Hz mono), then `media` (base64 μ-law, 20 ms each), `dtmf` (a key the caller pressed: the
serializer makes it an InputDTMFFrame), `mark` (echoing ours when its audio has played) and `stop`.

pipecat's TwilioFrameSerializer turns valid messages into frames but drops or chokes on invalid
ones silently. A bad message here closes the socket with a WebSocket close code and a reason, and
is logged; only that call ends.

| input | close code | reason starts with |
| --- | --- | --- |
| binary frame | 1003 | binary frames are not part of Media Streams |
| over `max_message_bytes` | 1009 | message too big |
| not JSON, not an object, no `event` | 1007 | message is not JSON / ... |
| unknown event | 1002 | unknown event |
| media, dtmf or mark before start; a second start | 1002 | ... before start / duplicate start |
| start without streamSid, or not μ-law 8000 Hz mono | 1003 | unsupported media format / ... |
| media payload that is not base64 | 1007 | media payload is not valid base64 |
| media payload over `max_media_payload_bytes` | 1009 | media payload too big |
| media faster than `max_media_speed` x real time | 1008 | media faster than real time |
| a peer that reads nothing for `send_timeout_s` | 1011 | peer not reading |
| a streamSid other than the call's | 1002 | streamSid mismatch |
| `mark` without a name, `dtmf` without a keypad digit | 1007 | mark/dtmf event without ... |
| `stop` | 1000 | stream stopped |
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loguru import logger
from pipecat.audio.dtmf.types import KeypadEntry
from starlette.websockets import WebSocket, WebSocketState

from voiceagent.config import ServerConfig

EVENTS = {"connected", "start", "media", "dtmf", "mark", "stop"}
MEDIA_FORMAT = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}
MULAW_BYTES_PER_S = 8000
KEYPAD = frozenset(KeypadEntry)  # the digits the serializer turns into InputDTMFFrame


class ProtocolViolation(Exception):
    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass
class StreamStart:
    stream_sid: str
    call_sid: str | None
    custom_parameters: dict = field(default_factory=dict)


def parse(raw: dict, max_bytes: int) -> dict:
    """An ASGI websocket.receive message -> the JSON object it carries."""
    if raw.get("bytes") is not None:
        raise ProtocolViolation(1003, "binary frames are not part of Media Streams")
    text = raw.get("text") or ""
    # UTF-8 is at most 4 bytes a character: most messages need no encoding to be measured.
    size = len(text) if 4 * len(text) <= max_bytes else len(text.encode())
    if size > max_bytes:
        raise ProtocolViolation(1009, f"message too big: {size} > {max_bytes} bytes")
    try:
        message = json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # nested deeper than Python recurses
        raise ProtocolViolation(1007, "message is not JSON") from None
    if not isinstance(message, dict) or not isinstance(message.get("event"), str):
        raise ProtocolViolation(1007, "message is not a JSON object with an 'event'")
    if message["event"] not in EVENTS:
        raise ProtocolViolation(1002, f"unknown event '{message['event'][:40]}'")
    return message


def parse_start(message: dict) -> StreamStart:
    start = message.get("start")
    if not isinstance(start, dict):
        raise ProtocolViolation(1002, "start event without a 'start' object")
    sid = start.get("streamSid") or message.get("streamSid")
    if not isinstance(sid, str) or not sid:
        raise ProtocolViolation(1003, "start event without a streamSid")
    fmt = start.get("mediaFormat")
    if not isinstance(fmt, dict) or any(fmt.get(k) != v for k, v in MEDIA_FORMAT.items()):
        raise ProtocolViolation(
            1003, f"unsupported media format {json.dumps(fmt)}: need audio/x-mulaw 8000 Hz mono"
        )
    params = start.get("customParameters") or {}
    if not isinstance(params, dict):
        raise ProtocolViolation(1002, "customParameters must be an object")
    call_sid = start.get("callSid")
    return StreamStart(sid, call_sid if isinstance(call_sid, str) else None, params)


def check_in_call(message: dict, stream_sid: str, max_payload: int = 1 << 30) -> int:
    """A message after `start`: the same stream, and media that decodes to at most
    `max_payload` bytes. Returns the bytes of audio it carries."""
    event = message["event"]
    if event in ("start", "connected"):
        raise ProtocolViolation(1002, f"duplicate {event}")
    if message.get("streamSid", stream_sid) != stream_sid:
        raise ProtocolViolation(1002, "streamSid mismatch")
    if event == "media":
        media = message.get("media")
        payload = media.get("payload") if isinstance(media, dict) else None
        if not isinstance(payload, str):
            raise ProtocolViolation(1007, "media event without a payload")
        if len(payload) > 4 * (max_payload // 3 + 1):  # measured before decoding it
            raise ProtocolViolation(1009, f"media payload too big: over {max_payload} bytes")
        try:
            audio = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolViolation(1007, "media payload is not valid base64") from None
        if len(audio) > max_payload:
            raise ProtocolViolation(1009, f"media payload too big: {len(audio)} > {max_payload}")
        return len(audio)
    for name, key in (("mark", "name"), ("dtmf", "digit")):
        body = message.get(name)
        if event == name and not (isinstance(body, dict) and isinstance(body.get(key), str)):
            raise ProtocolViolation(1007, f"{name} event without a {key}")
    # The serializer would drop any other digit without a word.
    if event == "dtmf" and message["dtmf"]["digit"] not in KEYPAD:
        raise ProtocolViolation(1007, "dtmf event without a digit: 0-9, * or # "
                                f"(got '{message['dtmf']['digit'][:8]}')")
    return 0


class MediaBudget:
    """A token bucket in seconds of audio: refilled at `speed` x real time, holding at most
    `burst_s`. A peer that sends faster for longer than the burst allows is refused: it would
    grow pipecat's input queue without bound."""

    def __init__(self, speed: float, burst_s: float, clock: Callable[[], float] = time.monotonic):
        self.speed, self.burst_s, self._clock = speed, burst_s, clock
        self._level, self._at = burst_s, clock()

    def spend(self, audio_s: float) -> bool:
        now = self._clock()
        self._level = min(self.burst_s, self._level + (now - self._at) * self.speed) - audio_s
        self._at = now
        return self._level >= 0


class MediaStreamSocket:
    """The WebSocket that pipecat's FastAPIWebsocketTransport reads, with every inbound message
    checked first. A violation closes the socket with its code and reason and reads as a
    disconnect, so the transport ends the call the way it ends any hang-up."""

    def __init__(self, ws: WebSocket, limits: ServerConfig, on_refused=None):
        self._ws = ws
        self._limits = limits
        self._max_bytes = limits.max_message_bytes
        self._budget = MediaBudget(limits.max_media_speed, limits.media_burst_s)
        self._on_refused = on_refused  # called with the close code of every abnormal close
        self.on_stalled: Callable[[], None] | None = None  # the peer stopped reading
        self._pending: tuple[int, str | None] = (1000, None)
        self.start: StreamStart | None = None
        self.marks_played = 0  # our marks Twilio echoed: utterances the caller heard to the end
        self.close_reason: tuple[int, str] | None = None

    def __getattr__(self, name):  # everything but receive/close is the plain WebSocket
        return getattr(self._ws, name)

    async def handshake(self) -> StreamStart:
        """Read `connected` (optional) and `start`; any other first message is a violation."""
        while self.start is None:
            raw = await self._ws.receive()
            if raw["type"] == "websocket.disconnect":
                raise ProtocolViolation(1000, "hung up before start")
            message = parse(raw, self._max_bytes)
            if message["event"] == "start":
                self.start = parse_start(message)
            elif message["event"] != "connected":
                raise ProtocolViolation(1002, f"{message['event']} before start")
        return self.start

    async def receive(self) -> dict:
        raw = await self._ws.receive()
        if raw["type"] == "websocket.disconnect":
            return raw
        try:
            message = parse(raw, self._max_bytes)
            audio = check_in_call(message, self.start.stream_sid,
                                  self._limits.max_media_payload_bytes)
            if audio and not self._budget.spend(audio / MULAW_BYTES_PER_S):
                raise ProtocolViolation(1008, "media faster than real time: "
                                        f"over {self._limits.max_media_speed:g}x")
        except ProtocolViolation as v:
            await self.close(v.code, v.reason)
            return {"type": "websocket.disconnect", "code": v.code}
        if message["event"] == "stop":
            await self.close(1000, "stream stopped")
            return {"type": "websocket.disconnect", "code": 1000}
        if message["event"] == "mark":
            self.marks_played += 1
        return raw

    async def send_text(self, data: str) -> None:
        await self._send(self._ws.send_text(data))

    async def send_bytes(self, data: bytes) -> None:
        await self._send(self._ws.send_bytes(data))

    async def _send(self, sending) -> None:
        """A send that cannot drain within `send_timeout_s` means the peer stopped reading: the
        call is ended (`on_stalled`) rather than left holding its slot."""
        try:
            # asyncio.timeout, not wait_for: no task made per frame on the audio path.
            async with asyncio.timeout(self._limits.send_timeout_s):
                await sending
        except TimeoutError:
            if self.close_reason is None and self.on_stalled is not None:
                self.on_stalled()
            raise

    def will_close(self, code: int, reason: str) -> None:
        """The code and reason of the close to come, whoever closes (the transport closes the
        socket itself when its pipeline is cancelled)."""
        self._pending = (code, reason)

    async def close(self, code: int | None = None, reason: str | None = None) -> None:
        """Close once, waiting at most `close_timeout_s` for the peer (one that stopped reading
        never completes the handshake); later calls (the transport's teardown) do nothing."""
        if code is None:
            code, reason = self._pending
        if self.close_reason is not None:
            return
        # A close frame's reason is at most 123 bytes (RFC 6455 5.5); the log keeps it whole.
        short = (reason or "").encode()[:123].decode(errors="ignore")
        self.close_reason = (code, reason or "")
        sid = self.start.stream_sid if self.start else "-"
        normal = code in (1000, 1001)
        (logger.info if normal else logger.warning)(
            f"twilio stream {sid}: closing ({code}) {reason or ''}")
        if not normal and self._on_refused is not None:
            self._on_refused(code)
        if self._ws.application_state == WebSocketState.CONNECTED:
            try:
                await asyncio.wait_for(self._ws.close(code, short), self._limits.close_timeout_s)
            except Exception as exc:  # the peer's close crossed ours, it vanished, or is stuck
                logger.debug(f"twilio stream {sid}: close failed: {exc!r}")
