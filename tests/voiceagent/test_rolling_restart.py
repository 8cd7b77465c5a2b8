"""A deploy behind the shipped nginx (deploy/nginx/voiceagent.conf): one of two real `serve`
processes drains while calls are in progress and new ones arrive, and no call is cut.

The drain is the one SIGTERM starts (`test_server_lifecycle` sends the signal), asked for here
through `POST /admin/drain` on the process's own port, as an operator's script may.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx
import pytest

from tests.audio.speech import speech
from tests.voiceagent.nginx_proc import NGINX, SERVER_ENV, TOKEN, Front, Proxy
from tests.voiceagent.server_proc import running_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(NGINX is None, reason="nginx is not installed (scripts/setup.sh --dev)"),
]

REPLY_TIMEOUT_S = 90  # a reply from one of two subprocess servers on a busy 2-core machine
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _calls(http: httpx.AsyncClient, base: str) -> tuple[int, str]:
    r = await http.get(f"{base}/healthz")
    return r.json().get("calls", 0), r.json()["status"]


async def _answered(caller, audio) -> bool:
    said = await caller.say(audio)
    return await caller.wait(lambda r: r.media_after(said.ended) is not None, REPLY_TIMEOUT_S)


async def test_draining_one_process_behind_nginx_cuts_no_call(tmp_path):
    front = Front(tmp_path)

    def server(name: str):
        return running_server("--set", f"paths.runs_dir={tmp_path}/{name}",
                              "--set", f"server.public_url={front.public_url}", env=SERVER_ENV)

    with server("a") as a, server("b") as b, \
            front.running((urlsplit(a).port, urlsplit(b).port)) as proxy:
        await _drain_with_calls(proxy, a, b)


async def _drain_with_calls(proxy: Proxy, a: str, b: str) -> None:
    # Synthesised before the calls start: Piper on the event loop would stall the callers'
    # media, which then arrives in a burst faster than real time (and is refused as a flood).
    capital, moon = speech("What is the capital of France?"), speech("How far away is the moon?")
    async with proxy.twilio() as first, proxy.twilio() as second, httpx.AsyncClient() as http:
        await first.start()
        await second.start()
        await asyncio.sleep(1.0)  # both calls hold a slot: one on each process (least_conn)
        assert [(await _calls(http, base))[0] for base in (a, b)] == [1, 1]
        # The deploy drains a: its call goes on, new calls must go to b.
        drained = await http.post(f"{a}/admin/drain", headers=AUTH)
        assert drained.status_code == 202, drained.text
        assert await _calls(http, a) == (1, "draining")
        # New calls while a drains: nginx tries a (one open connection each), is refused with
        # 503 before the upgrade, and takes them to b.
        async with proxy.twilio() as third, proxy.twilio() as fourth:
            await third.start()
            await fourth.start()
            answers = await asyncio.gather(*(_answered(c, capital)
                                               for c in (first, third)))
            assert all(answers), [(c.received.close_code, c.received.close_reason)
                                  for c in (first, second, third, fourth)]
            assert await _answered(fourth, moon)
            assert (await _calls(http, b))[0] == 3  # second, third and fourth
            for caller in (third, fourth):
                assert caller.received.close_code is None, caller.received.close_reason
                await caller.hang_up()
        assert await _answered(second, moon)
        for caller in (first, second):
            assert caller.received.close_code is None, caller.received.close_reason
            await caller.hang_up()
    async with httpx.AsyncClient() as http:
        for _ in range(100):  # a's last call is over: it stops
            try:
                await http.get(f"{a}/healthz")
            except httpx.TransportError:
                return
            await asyncio.sleep(0.2)
    raise AssertionError("the drained process did not stop after its last call")
