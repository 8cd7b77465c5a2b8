"""A simulated Twilio Media Streams peer: plays a phone caller against `WS /telephony/twilio`.

Like Twilio it sends `connected` and `start`, then 20 ms of μ-law 8 kHz `media` every 20 ms for
as long as the call lasts (silence between utterances), a `dtmf` for each key pressed, echoes
each `mark` it receives, and on hang-up sends `stop`. Everything it receives is time-stamped on
its own monotonic clock, so round trips (the caller stops talking -> the first bot audio
arrives) are measured end to end. Used by the server tests and `voiceagent bench serve`.
"""

from __future__ import annotations

import asyncio
import audioop  # μ-law, as pipecat's serializer does it; audioop-lts provides it on 3.13+
import base64
import json
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import websockets

from audio.wav import resample

RATE = 8000
CHUNK = RATE // 50  # 20 ms
SILENCE = audioop.lin2ulaw(bytes(2 * CHUNK), 2)


@dataclass
class Utterance:
    started: float  # monotonic time its first chunk was sent
    ended: float  # ... its last chunk


@dataclass
class Received:
    media: list[tuple[float, int]] = field(default_factory=list)  # (time, μ-law bytes)
    marks: list[tuple[float, str]] = field(default_factory=list)
    clears: list[float] = field(default_factory=list)
    other: list[dict] = field(default_factory=list)
    close_code: int | None = None
    close_reason: str = ""

    def media_after(self, t: float) -> float | None:
        return next((at for at, _ in self.media if at >= t), None)

    def audio_seconds(self) -> float:
        return sum(n for _, n in self.media) / RATE


class TwilioCaller:
    def __init__(self, url: str, *, token: str | None = None, headers: dict | None = None,
                 custom_parameters: dict | None = None):
        self.url = url
        self.headers = dict(headers or {})
        self.custom_parameters = dict(custom_parameters or {})
        if token:
            self.custom_parameters["token"] = token
        self.stream_sid = "MZ" + uuid.uuid4().hex
        self.call_sid = "CA" + uuid.uuid4().hex
        self.received = Received()
        self._ws = None
        self._outbox: asyncio.Queue[tuple[bytes, list[asyncio.Future]]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._seq = 0
        self.closed = asyncio.Event()

    async def __aenter__(self) -> TwilioCaller:
        self._ws = await websockets.connect(self.url, additional_headers=self.headers,
                                            max_size=None)
        self._tasks.append(asyncio.create_task(self._read()))
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks:
            task.cancel()
        await self._ws.close()

    async def send(self, message: dict | str | bytes) -> None:
        """Send one raw message (dicts as JSON); closed sockets are ignored."""
        data = json.dumps(message) if isinstance(message, dict) else message
        try:
            await self._ws.send(data)
        except websockets.ConnectionClosed:
            pass

    def _next_seq(self) -> str:
        self._seq += 1
        return str(self._seq)

    async def start(self, media_format: dict | None = None, stream: bool = True) -> None:
        """`connected` and `start`, then (with `stream`) media every 20 ms until hang-up."""
        await self.send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        fmt = media_format or {"encoding": "audio/x-mulaw", "sampleRate": RATE, "channels": 1}
        await self.send({
            "event": "start", "sequenceNumber": self._next_seq(), "streamSid": self.stream_sid,
            "start": {
                "accountSid": "AC" + "0" * 32, "streamSid": self.stream_sid,
                "callSid": self.call_sid, "tracks": ["inbound"], "mediaFormat": fmt,
                "customParameters": self.custom_parameters,
            },
        })
        if stream:
            self._tasks.append(asyncio.create_task(self._stream()))

    async def say(self, audio: np.ndarray, rate: int = 16000) -> Utterance:
        """Queue `audio` (int16 mono) into the stream; return once its last chunk was sent."""
        pcm = resample(np.asarray(audio, np.int16), rate, RATE)
        pcm = np.pad(pcm, (0, -len(pcm) % CHUNK))
        chunks = [audioop.lin2ulaw(pcm[i:i + CHUNK].tobytes(), 2)
                  for i in range(0, len(pcm), CHUNK)]
        loop = asyncio.get_running_loop()
        first, last = loop.create_future(), loop.create_future()
        for i, chunk in enumerate(chunks):
            marks = [f for f, at in ((first, 0), (last, len(chunks) - 1)) if at == i]
            await self._outbox.put((chunk, marks))
        return Utterance(await self._sent(first), await self._sent(last))

    async def _sent(self, chunk: asyncio.Future) -> float:
        """When a queued chunk went out; if the call closes first (hung up, or refused by the
        server) it never will: then, the time this finds it closed. `received.close_code` says
        why."""
        closed = asyncio.ensure_future(self.closed.wait())
        try:
            await asyncio.wait({chunk, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
        return chunk.result() if chunk.done() else time.monotonic()

    async def _stream(self) -> None:
        t0 = time.monotonic()
        n = 0
        while not self.closed.is_set():
            try:
                chunk, sent = self._outbox.get_nowait()
            except asyncio.QueueEmpty:
                chunk, sent = SILENCE, []
            await self.media(chunk, chunk_no=n)
            now = time.monotonic()
            for future in sent:
                future.set_result(now)
            n += 1
            await asyncio.sleep(max(0.0, t0 + n * 0.02 - time.monotonic()))

    async def media(self, ulaw: bytes, chunk_no: int = 0) -> None:
        await self.send({
            "event": "media", "sequenceNumber": self._next_seq(), "streamSid": self.stream_sid,
            "media": {"track": "inbound", "chunk": str(chunk_no),
                      "timestamp": str(20 * chunk_no),
                      "payload": base64.b64encode(ulaw).decode()},
        })

    async def dtmf(self, digit: str) -> float:
        """Press a key (0-9, * or #) as Twilio reports it; returns when it was sent."""
        await self.send({"event": "dtmf", "sequenceNumber": self._next_seq(),
                         "streamSid": self.stream_sid,
                         "dtmf": {"track": "inbound_track", "digit": digit}})
        return time.monotonic()

    async def hang_up(self) -> None:
        self.closed.set()
        await self.send({"event": "stop", "sequenceNumber": self._next_seq(),
                         "streamSid": self.stream_sid,
                         "stop": {"accountSid": "AC" + "0" * 32, "callSid": self.call_sid}})

    async def wait(self, predicate, timeout: float) -> bool:
        """Poll `predicate(received)` until true or `timeout` seconds; False on timeout."""
        deadline = time.monotonic() + timeout
        while not predicate(self.received):
            if time.monotonic() > deadline or self.closed.is_set():
                return bool(predicate(self.received))
            await asyncio.sleep(0.02)
        return True

    async def reply(self, after: float, timeout: float, quiet_s: float = 1.5) -> float | None:
        """Wait for the bot's reply to speech that ended at `after`: its first media, then
        `quiet_s` without media. Returns when the reply's audio started arriving, or None."""
        if not await self.wait(lambda r: r.media_after(after) is not None, timeout):
            return None
        first = self.received.media_after(after)
        while not self.closed.is_set():
            last = self.received.media[-1][0]
            if time.monotonic() - last >= quiet_s:
                break
            await asyncio.sleep(0.05)
        return first

    async def _read(self) -> None:
        try:
            async for data in self._ws:
                now = time.monotonic()
                message = json.loads(data)
                event = message.get("event")
                if event == "media":
                    payload = base64.b64decode(message["media"]["payload"])
                    self.received.media.append((now, len(payload)))
                elif event == "mark":
                    name = message["mark"]["name"]
                    self.received.marks.append((now, name))
                    await self.send({"event": "mark", "sequenceNumber": self._next_seq(),
                                     "streamSid": self.stream_sid, "mark": {"name": name}})
                elif event == "clear":
                    self.received.clears.append(now)
                else:
                    self.received.other.append(message)
        except websockets.ConnectionClosed:
            pass
        finally:
            self.received.close_code = self._ws.close_code
            self.received.close_reason = self._ws.close_reason or ""
            self.closed.set()
