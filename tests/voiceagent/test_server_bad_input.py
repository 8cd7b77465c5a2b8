"""Malformed Twilio input: each bad message gets its documented close code and reason (the table
in voiceagent/server/media_streams.py), the server stays healthy, and a good call goes on."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.audio.speech import speech
from tests.voiceagent.serving import server_config, serving, until
from tests.voiceagent.serving import twilio_url as ws_url
from voiceagent.sim.twilio_caller import TwilioCaller

pytestmark = pytest.mark.slow


def _media(sid: str, payload: str) -> dict:
    return {"event": "media", "streamSid": sid, "media": {"payload": payload}}


# name -> (send start first?, message to send (callable of the caller), close code, reason prefix)
BAD_INPUT = {
    "binary frame": (True, lambda c: b"\x00\x01\x02", 1003, "binary frames"),
    "not JSON": (True, lambda c: "hello there", 1007, "message is not JSON"),
    "JSON but not an object": (True, lambda c: "[1, 2]", 1007, "message is not a JSON object"),
    "unknown event": (True, lambda c: {"event": "dance"}, 1002, "unknown event 'dance'"),
    "media before start": (False, lambda c: _media(c.stream_sid, "//8="), 1002,
                           "media before start"),
    "invalid base64": (True, lambda c: _media(c.stream_sid, "!!not base64!!"), 1007,
                       "media payload is not valid base64"),
    "oversized frame": (True, lambda c: _media(c.stream_sid, "A" * 100_000), 1009,
                        "message too big"),
    "another stream's media": (True, lambda c: _media("MZother", "//8="), 1002,
                               "streamSid mismatch"),
    "second start": (True, lambda c: {"event": "start", "start": {}}, 1002, "duplicate start"),
    "mark without a name": (True, lambda c: {"event": "mark", "mark": "x"}, 1007,
                            "mark event without a name"),
    "dtmf without a digit": (True, lambda c: {"event": "dtmf", "dtmf": {}}, 1007,
                             "dtmf event without a digit"),
}
WRONG_RATE = {"encoding": "audio/x-mulaw", "sampleRate": 16000, "channels": 1}


async def _bad_client(base: str, name: str) -> tuple[int | None, str]:
    started, message, _code, _reason = BAD_INPUT[name]
    async with TwilioCaller(ws_url(base)) as caller:
        if started:
            await caller.start(stream=False)
        else:
            await caller.send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await caller.send(message(caller))
        await caller.wait(lambda r: r.close_code is not None, 5)
    return caller.received.close_code, caller.received.close_reason


async def _healthy(base: str) -> bool:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{base}/healthz")).status_code == 200


@pytest.mark.parametrize("name", list(BAD_INPUT))
async def test_bad_message_closes_with_its_code_and_reason(tmp_path, models, name):
    async with serving(server_config(tmp_path), models) as (app, base):
        code, reason = await _bad_client(base, name)
        assert (code, reason[: len(BAD_INPUT[name][3])]) == BAD_INPUT[name][2:]
        assert await _healthy(base)
        # The slot frees as the call's pipeline ends, just after the close frame goes out.
        freed = await until(lambda: not app.state.server.calls.active, 5)
        assert freed, "a refused call kept its slot"


async def test_a_wrong_sample_rate_is_refused_at_start(tmp_path, models):
    async with serving(server_config(tmp_path), models) as (_app, base):
        async with TwilioCaller(ws_url(base)) as caller:
            await caller.start(media_format=WRONG_RATE, stream=False)
            await caller.wait(lambda r: r.close_code is not None, 5)
        assert caller.received.close_code == 1003
        assert "unsupported media format" in caller.received.close_reason


async def test_a_good_call_completes_while_bad_clients_are_closed(tmp_path, models):
    async with serving(server_config(tmp_path), models) as (_app, base):
        async with TwilioCaller(ws_url(base)) as good:
            await good.start()
            said = asyncio.create_task(good.say(speech("What is the capital of France?")))
            outcomes = {name: await _bad_client(base, name) for name in BAD_INPUT}
            ended = (await said).ended
            assert await good.wait(lambda r: r.media_after(ended) and r.marks, 45)
            assert good.received.close_code is None
            await good.hang_up()
        assert {n: o[0] for n, o in outcomes.items()} == {n: v[2] for n, v in BAD_INPUT.items()}
        assert await _healthy(base)


async def test_a_bad_offer_is_a_400_and_an_unknown_peer_a_404(tmp_path, models):
    async with serving(server_config(tmp_path), models) as (_app, base):
        async with httpx.AsyncClient(base_url=base) as http:
            assert (await http.post("/api/offer", content=b"{nope")).status_code == 400
            bad_sdp = {"sdp": "v=0 garbage", "type": "offer"}
            assert (await http.post("/api/offer", json=bad_sdp)).status_code == 400
            patch = {"pc_id": "nobody", "candidates": []}
            assert (await http.patch("/api/offer", json=patch)).status_code == 404
            assert (await http.patch("/api/offer", json={"candidates": []})).status_code == 400
            big = json.dumps({"sdp": "x" * 100_000, "type": "offer"})
            assert (await http.post("/api/offer", content=big)).status_code == 413
        assert await _healthy(base)


async def test_the_offer_needs_the_token_when_one_is_set(tmp_path, models):
    async with serving(server_config(tmp_path, "server.token=s3cret"), models) as (_app, base):
        async with httpx.AsyncClient(base_url=base) as http:
            offer = {"sdp": "v=0 garbage", "type": "offer"}
            assert (await http.post("/api/offer", json=offer)).status_code == 401
            authed = await http.post("/api/offer", json=offer,
                                     headers={"Authorization": "Bearer s3cret"})
            assert authed.status_code == 400  # past the guard: the SDP itself is refused
