"""Bounded resources on a live server: media size and rate, call length, peers that vanish or stop
reading lose their slot within the configured bound, and the last turn of every call is kept."""

from __future__ import annotations

import asyncio
import audioop
import base64
import json
import os
import socket
import struct
import threading
import time

import pytest
from loguru import logger
from pipecat.frames.frames import EndFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.filters.identity_filter import IdentityFilter
from starlette.websockets import WebSocketState

from tests.audio.speech import speech
from tests.voiceagent.serving import server_config, serving, twilio_url, until
from voiceagent.server.calls import ActiveCall, CallRegistry
from voiceagent.server.media_streams import MediaStreamSocket
from voiceagent.sim.twilio_caller import TwilioCaller


@pytest.mark.slow
async def test_media_faster_than_real_time_is_refused_with_1008(tmp_path, models):
    async with serving(server_config(tmp_path), models) as (app, base):
        async with TwilioCaller(twilio_url(base)) as caller:
            await caller.start(stream=False)
            for n in range(200):  # 4 s of audio at once: twice the 2 s burst
                await caller.media(b"\xff" * 160, chunk_no=n)
            await caller.wait(lambda r: r.close_code is not None, 10)
        assert caller.received.close_code == 1008
        assert caller.received.close_reason.startswith("media faster than real time")
        assert await until(lambda: not app.state.server.calls.active, 5)


@pytest.mark.slow
async def test_an_oversized_media_payload_is_closed_with_1009(tmp_path, models):
    async with serving(server_config(tmp_path), models) as (_app, base):
        async with TwilioCaller(twilio_url(base)) as caller:
            await caller.start(stream=False)
            await caller.media(b"\xff" * 4000)  # Twilio sends 160 bytes; the limit is 1600
            await caller.wait(lambda r: r.close_code is not None, 10)
    assert caller.received.close_code == 1009
    assert caller.received.close_reason.startswith("media payload too big")


@pytest.mark.slow
async def test_a_call_is_ended_at_its_length_limit(tmp_path, models):
    async with serving(server_config(tmp_path, "server.max_call_s=2"), models) as (app, base):
        async with TwilioCaller(twilio_url(base)) as caller:
            t0 = time.monotonic()
            await caller.start()  # streams silence: never idle
            await caller.wait(lambda r: r.close_code is not None, 15)
            lasted = time.monotonic() - t0
        assert (caller.received.close_code, caller.received.close_reason) == (
            1000, "call length limit: 2 s")
        assert lasted < 2 + 3
        assert await until(lambda: not app.state.server.calls.active, 5)


class RawPeer:
    """A Media Streams peer on a bare socket: it sends what it is told and never reads, and never
    answers a close: a phone leg whose network died, or a client that stopped reading."""

    def __init__(self, url: str, receive_buffer: int = 0):
        host, _, rest = url.removeprefix("ws://").partition("/")
        self.host, port = host.split(":")
        self.port, self.path = int(port), "/" + rest
        self.receive_buffer = receive_buffer  # 0: the kernel's autotuned window
        self.sock: socket.socket | None = None

    def connect(self) -> None:
        self.sock = socket.socket()
        if self.receive_buffer:  # before connect: the window is agreed at the handshake
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer)
        self.sock.connect((self.host, self.port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += self.sock.recv(1)  # only the handshake is read, byte by byte
        assert reply.startswith(b"HTTP/1.1 101"), reply

    def send_text(self, text: str) -> None:
        data, mask = text.encode(), os.urandom(4)
        n = len(data)
        header = struct.pack("!BB", 0x81, 0x80 | n) if n < 126 else struct.pack(
            "!BBH", 0x81, 0x80 | 126, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        self.sock.sendall(header + mask + masked)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.slow
async def test_a_vanished_peer_loses_its_slot_within_the_bound(tmp_path, models):
    cfg = server_config(tmp_path, "server.idle_timeout_s=1", "server.close_timeout_s=1")
    async with serving(cfg, models) as (app, base):
        peer = RawPeer(twilio_url(base))
        await asyncio.to_thread(peer.connect)
        peer.send_text(_start("MZvanished"))
        calls = app.state.server.calls
        assert await until(lambda: len(calls.active) == 1, 5)
        # then silence, and nothing read: the slot must be free within idle + close timeouts
        # (and a second of slack)
        freed = await until(lambda: not calls.active, 1 + 1 + 1)
        peer.close()
    assert freed


def _start(sid: str) -> str:
    return json.dumps({"event": "start", "streamSid": sid, "start": {
        "streamSid": sid, "callSid": "CA" + sid,
        "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})


def _stream(peer: RawPeer, sid: str, mulaw: bytes, stop: threading.Event) -> None:
    """`mulaw`, then silence, in 20 ms media messages at real time, as Twilio sends a caller,
    until `stop` or the server drops the connection."""
    audio = mulaw + b"\xff" * (8000 * 120)
    t0 = time.monotonic()
    for n in range(len(audio) // 160):
        if stop.is_set():
            return
        payload = base64.b64encode(audio[n * 160:(n + 1) * 160]).decode()
        try:
            peer.send_text(json.dumps({"event": "media", "streamSid": sid,
                                       "media": {"payload": payload}}))
        except OSError:
            return
        time.sleep(max(0.0, t0 + (n + 1) * 0.02 - time.monotonic()))


@pytest.mark.slow
async def test_a_peer_whose_receive_window_is_full_loses_its_call(tmp_path, models):
    """A real socket whose peer goes on sending its caller's audio but never reads: once the
    bot's long reply has filled the TCP window and the server's bounded send buffer, the send
    times out and the call ends with 1011, its slot free. (With the kernel's autotuned 4 MB
    buffer the reply fits in the buffers: only uvicorn's unanswered ping ends the call, 40 s on;
    `server.send_buffer_bytes=0` fails this.)"""
    cfg = server_config(tmp_path, "server.send_timeout_s=1", "server.close_timeout_s=1",
                        "engine.sampling.max_new_tokens=200")
    cfg.agent.system_prompt = "Always answer with a long story of at least ten sentences."
    question = audioop.lin2ulaw(speech("Tell me a long story about a dragon.", 8000).tobytes(),
                                2)
    closes: list[str] = []
    sink = logger.add(lambda m: closes.append(m.record["message"]), level="INFO",
                      filter=lambda r: "MZstalled: closing" in r["message"])
    async with serving(cfg, models) as (app, base):
        calls = app.state.server.calls
        peer = RawPeer(twilio_url(base), receive_buffer=4096)
        await asyncio.to_thread(peer.connect)
        peer.send_text(_start("MZstalled"))
        stop = threading.Event()
        streaming = asyncio.create_task(
            asyncio.to_thread(_stream, peer, "MZstalled", question, stop))
        try:
            assert await until(lambda: len(calls.active) == 1, 5)
            t0 = time.monotonic()
            # ~2 s of question, ~1 s to the reply; 64 KiB of buffer (Linux doubles it) and
            # asyncio's 64 KiB take about 7 s of sending (audio goes at twice real time); then
            # the send and the close time out (1 s each).
            freed = await until(lambda: not calls.active, 30)
            took = time.monotonic() - t0
        finally:
            stop.set()
            await streaming
            peer.close()
            logger.remove(sink)
    print(f"stalled peer: call ended {took:.1f} s after it started: {closes}")
    assert freed
    assert closes and "closing (1011) peer not reading" in closes[0]


class StuckPeer:
    """The far side of a WebSocket whose buffers are full: a send or close never completes."""

    application_state = WebSocketState.CONNECTED

    async def send_text(self, _data: str) -> None:
        await asyncio.Event().wait()

    async def close(self, _code: int, _reason: str) -> None:
        await asyncio.Event().wait()


async def test_a_peer_that_stops_reading_is_ended_after_the_send_timeout(tmp_path):
    limits = server_config(tmp_path, "server.send_timeout_s=0.2",
                           "server.close_timeout_s=0.2").server
    sock = MediaStreamSocket(StuckPeer(), limits)
    stalled = []
    sock.on_stalled = lambda: stalled.append(time.monotonic())
    t0 = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        await sock.send_text('{"event": "media"}')
    await asyncio.wait_for(sock.close(1011, "peer not reading"), 2)  # bounded, not stuck
    assert len(stalled) == 1 and stalled[0] - t0 < 1
    assert time.monotonic() - t0 < 1.5


async def test_the_last_turn_is_recorded_when_a_call_ends_before_its_answer_does():
    registry = CallRegistry(max_calls=1)
    events: list[str] = []
    registry.listeners.append(lambda event, _call: events.append(event))
    call = registry.reserve("webrtc")
    task = PipelineWorker(Pipeline([IdentityFilter()]))
    running = asyncio.create_task(registry.run(call, task, lambda: events.append("flushed")))
    await asyncio.sleep(0.2)
    await task.queue_frame(EndFrame())
    await asyncio.wait_for(running, 10)
    assert events == ["started", "flushed", "ended"]
    assert isinstance(call, ActiveCall) and not registry.active


async def test_waiting_for_idle_slots_returns_once_the_last_call_is_released():
    registry = CallRegistry(max_calls=2)
    call = registry.reserve("twilio")
    with pytest.raises(TimeoutError, match="1 call.s. still hold a slot"):
        await registry.wait_idle(0.2)
    asyncio.get_running_loop().call_later(0.1, registry.release, call)
    await asyncio.wait_for(registry.wait_idle(5), 1)
    assert not registry.active


async def test_a_browser_call_that_never_connects_frees_its_slot(tmp_path, models):
    """An offer whose peer never completes ICE (its page closed, a firewall) holds a slot only
    until `connect_timeout_s`, not until the idle timeout."""
    import httpx
    from aiortc import RTCPeerConnection

    cfg = server_config(tmp_path, "server.connect_timeout_s=1", "server.idle_timeout_s=60")
    async with serving(cfg, models) as (app, base):
        pc = RTCPeerConnection()
        pc.addTransceiver("audio", direction="sendrecv")
        await pc.setLocalDescription(await pc.createOffer())
        async with httpx.AsyncClient(base_url=base) as http:
            answer = await http.post("/api/offer", json={"sdp": pc.localDescription.sdp,
                                                         "type": "offer"})
        await pc.close()  # the answer is never applied: no ICE, no DTLS
        calls = app.state.server.calls
        held = len(calls.active)
        freed = await until(lambda: not calls.active, 1 + 3)
    assert answer.status_code == 200 and held == 1
    assert freed
