"""A simulated Twilio Media Streams peer: plays a phone caller against `WS /telephony/twilio`.

Like Twilio it sends `connected` and `start`, then 20 ms of μ-law 8 kHz `media` every 20 ms for
as long as the call lasts (silence between utterances), a `dtmf` for each key pressed, and on
hang-up sends `stop`. It plays the bot's media in real time, as a phone would: each `mark` is
echoed once the audio received before it has played, and a `clear` drops what is queued (its
marks are echoed at once). Everything it receives is time-stamped on
its own monotonic clock, so round trips (the caller stops talking -> the first bot audio
arrives) are measured end to end. Used by the server tests and `voiceagent bench serve`, and
from a shell: `python -m voiceagent.sim.twilio_caller ws://127.0.0.1:7860/telephony/twilio
question.wav` says each WAV in turn, waits for each reply and prints what the caller heard.
"""

from __future__ import annotations

import argparse
import asyncio
import audioop  # μ-law, as pipecat's serializer does it; audioop-lts provides it on 3.13+
import base64
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import websockets

from audio.wav import AudioFormatError, read_wav, resample, write_wav

RATE = 8000
CHUNK = RATE // 50  # 20 ms
SILENCE = audioop.lin2ulaw(bytes(2 * CHUNK), 2)
VOICED_RMS = 328  # -40 dBFS: a chunk louder than this carries speech (synthesised speech)


@dataclass
class Utterance:
    started: float  # monotonic time its first chunk was sent
    ended: float  # ... its last chunk
    voiced: float | None = None  # ... its first chunk louder than VOICED_RMS (None: none was)


@dataclass
class Received:
    media: list[tuple[float, int]] = field(default_factory=list)  # (time, μ-law bytes)
    audio: list[tuple[float, bytes]] = field(default_factory=list)  # (time, μ-law), keep_audio
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
                 custom_parameters: dict | None = None, keep_audio: bool = False):
        self.url = url
        self.keep_audio = keep_audio  # keep what the bot sent in `received.audio`
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
        self._played_until = 0.0  # monotonic time the bot's audio received so far ends playing
        self._unplayed: dict[str, asyncio.Task] = {}  # marks to echo when their audio has played
        self.closed = asyncio.Event()

    async def __aenter__(self) -> TwilioCaller:
        self._ws = await websockets.connect(self.url, additional_headers=self.headers,
                                            max_size=None)
        self._tasks.append(asyncio.create_task(self._read()))
        return self

    async def __aexit__(self, *exc) -> None:
        for task in [*self._tasks, *self._unplayed.values()]:
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
        pieces = [pcm[i:i + CHUNK] for i in range(0, len(pcm), CHUNK)]
        loud = next((i for i, p in enumerate(pieces)
                     if np.sqrt(np.mean(p.astype(np.float64) ** 2)) > VOICED_RMS), None)
        loop = asyncio.get_running_loop()
        first, voiced, last = (loop.create_future() for _ in range(3))
        for i, piece in enumerate(pieces):
            marks = [f for f, at in ((first, 0), (voiced, loud), (last, len(pieces) - 1))
                     if at == i]
            await self._outbox.put((audioop.lin2ulaw(piece.tobytes(), 2), marks))
        return Utterance(await self._sent(first), await self._sent(last),
                         await self._sent(voiced) if loud is not None else None)

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

    async def _echo_mark(self, name: str, after_s: float) -> None:
        """Echo our mark `name` once the audio before it has played (`after_s` from now)."""
        await asyncio.sleep(max(0.0, after_s))
        self._unplayed.pop(name, None)
        await self.send({"event": "mark", "sequenceNumber": self._next_seq(),
                         "streamSid": self.stream_sid, "mark": {"name": name}})

    async def _read(self) -> None:
        try:
            async for data in self._ws:
                now = time.monotonic()
                message = json.loads(data)
                event = message.get("event")
                if event == "media":
                    payload = base64.b64decode(message["media"]["payload"])
                    self.received.media.append((now, len(payload)))
                    if self.keep_audio:
                        self.received.audio.append((now, payload))
                    self._played_until = max(now, self._played_until) + len(payload) / RATE
                elif event == "mark":
                    name = message["mark"]["name"]
                    self.received.marks.append((now, name))
                    self._unplayed[name] = asyncio.create_task(
                        self._echo_mark(name, self._played_until - now))
                elif event == "clear":
                    self.received.clears.append(now)
                    self._played_until = now
                    for name, echo in list(self._unplayed.items()):
                        echo.cancel()
                        await self._echo_mark(name, 0.0)
                else:
                    self.received.other.append(message)
        except websockets.ConnectionClosed:
            pass
        finally:
            self.received.close_code = self._ws.close_code
            self.received.close_reason = self._ws.close_reason or ""
            self.closed.set()


def heard(received: Received, t0: float) -> np.ndarray:
    """What the caller heard, int16 at RATE on the call's timeline (silence between replies)."""
    out = np.zeros(0, np.int16)
    for at, payload in received.audio:
        pcm = np.frombuffer(audioop.ulaw2lin(payload, 2), np.int16)
        start = max(len(out), int((at - t0) * RATE) - len(pcm))  # it arrived by `at`
        out = np.concatenate([out, np.zeros(start - len(out), np.int16), pcm])
    return out


async def place_call(args: argparse.Namespace) -> dict:
    """One call: lead-in silence, then each WAV and the bot's reply to it; a summary."""
    utterances = [(str(path), read_wav(path, 16000)) for path in args.wav]
    headers = {}
    if args.twilio_auth_token:
        from twilio.request_validator import RequestValidator

        signed = RequestValidator(args.twilio_auth_token).compute_signature(args.url, {})
        headers["X-Twilio-Signature"] = signed
    params = dict(p.split("=", 1) for p in args.param)
    caller = TwilioCaller(args.url, token=args.token, headers=headers, custom_parameters=params,
                          keep_audio=bool(args.out))
    turns = []
    async with caller:
        await caller.start()
        t0 = time.monotonic()
        await asyncio.sleep(args.lead_in)
        for name, samples in utterances:
            said = await caller.say(samples, 16000)
            first = await caller.reply(said.ended, args.timeout, args.quiet)
            turns.append({
                "wav": name, "said_at_s": round(said.started - t0, 3),
                "said_s": round(said.ended - said.started, 3),
                "reply_after_ms": None if first is None else round(1000 * (first - said.ended)),
                "reply_audio_s": round(sum(n for at, n in caller.received.media
                                           if at >= said.ended) / RATE, 3),
            })
            if caller.closed.is_set():
                break
        await caller.hang_up()
        await caller.wait(lambda r: r.close_code is not None, 2.0)
    r = caller.received
    if args.out:
        write_wav(args.out, heard(r, t0), RATE)
    return {
        "call_sid": caller.call_sid, "url": args.url, "turns": turns,
        "heard_s": round(r.audio_seconds(), 3),
        "clears_at_s": [round(at - t0, 3) for at in r.clears],
        "marks": [{"at_s": round(at - t0, 3), "name": name} for at, name in r.marks],
        "close_code": r.close_code, "close_reason": r.close_reason,
    }


def summary_lines(call: dict) -> list[str]:
    lines = [f"call {call['call_sid']} to {call['url']} (times from the call's start)"]
    for turn in call["turns"]:
        answer = ("no reply" if turn["reply_after_ms"] is None else
                  f"the reply began {turn['reply_after_ms']} ms after it ended, "
                  f"{turn['reply_audio_s']:.2f} s of audio")
        lines.append(f"  said {turn['wav']} at {turn['said_at_s']:.2f} s "
                     f"({turn['said_s']:.2f} s): {answer}")
    clears = ", ".join(f"{t:.2f} s" for t in call["clears_at_s"]) or "none"
    marks = ", ".join(f"{m['name']} at {m['at_s']:.2f} s" for m in call["marks"]) or "none"
    lines += [f"heard {call['heard_s']:.2f} s of bot audio", f"clear: {clears}",
              f"marks: {marks}", f"closed: {call['close_code']} {call['close_reason']}".rstrip()]
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m voiceagent.sim.twilio_caller",
        description="A simulated Twilio Media Streams caller: connects to a voiceagent serve "
        "(or any Media Streams server), says each WAV in turn at real-time pace, waits for the "
        "bot's reply to each, hangs up, and prints what it heard: reply latency and length, "
        "the clears and marks it received, and how the call closed.")
    p.add_argument("url", help="the server's Media Streams WebSocket, e.g. "
                   "ws://127.0.0.1:7860/telephony/twilio")
    p.add_argument("wav", nargs="+", type=Path, help="caller audio, one WAV per utterance")
    p.add_argument("--token", default=os.environ.get("VOICEAGENT_TOKEN"),
                   help="the server's token, sent as the `token` custom parameter "
                   "(default: $VOICEAGENT_TOKEN)")
    p.add_argument("--twilio-auth-token", default=os.environ.get("TWILIO_AUTH_TOKEN"),
                   help="sign the request as Twilio does (X-Twilio-Signature over URL) for a "
                   "server that checks signatures (default: $TWILIO_AUTH_TOKEN)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a custom parameter of the `start` message (repeatable)")
    p.add_argument("--lead-in", type=float, default=1.0,
                   help="seconds of silence before the first utterance (default: 1)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds to wait for the bot's reply to each utterance (default: 30)")
    p.add_argument("--quiet", type=float, default=1.5,
                   help="a reply is over after this many seconds without audio (default: 1.5)")
    p.add_argument("--out", type=Path, help="write what the caller heard here (WAV, 8 kHz)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    """0: every utterance had a reply; 1: one had none, or the server closed the call; 2: the
    call could not be placed (bad WAV or parameter, server unreachable)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if any("=" not in p for p in args.param):
        parser.error("--param takes KEY=VALUE")
    try:
        call = asyncio.run(place_call(args))
    except AudioFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, websockets.InvalidURI, websockets.InvalidHandshake) as exc:
        print(f"error: cannot call {args.url}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(call) if args.json else "\n".join(summary_lines(call)))
    answered = all(t["reply_after_ms"] is not None for t in call["turns"])
    complete = len(call["turns"]) == len(args.wav)
    return 0 if answered and complete else 1


if __name__ == "__main__":
    sys.exit(main())
