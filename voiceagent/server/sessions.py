"""The pages' sign-in sessions: cookies that expire, a sign-out that ends them on the server, and
a limit on sign-in attempts per client address.

A session cookie is `expiry.nonce.mac`, where `mac` is an HMAC of the expiry and the nonce under
the server's token: it never holds the token, a new token ends every session, and the expiry
(`server.session_ttl_s`) is checked by whoever reads it, so several `serve` processes behind one
balancer accept each other's sessions. A sign-out revokes its session's nonce until its expiry in
this process: a copy of the cookie kept elsewhere no longer opens the pages here. (With several
processes, the others see the revocation only when the cookie expires: keep the TTL short there.)
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections import deque

MAX_REVOKED = 100_000  # nonces remembered at once; the oldest expiry goes first beyond this
MAX_CLIENTS = 10_000  # client addresses tracked by the attempt limit at once


def _mac(token: str, expires: int, nonce: str) -> str:
    message = f"voiceagent-session-v2|{expires}|{nonce}".encode()
    return hmac.new(token.encode("utf-8", "surrogatepass"), message, hashlib.sha256).hexdigest()


class Sessions:
    """Issues and checks session cookies for one server token; `clock` is wall-clock seconds."""

    def __init__(self, ttl_s: float, attempts_per_min: int, clock=time.time):
        self.ttl_s = ttl_s
        self.attempts_per_min = attempts_per_min
        self._clock = clock
        self._revoked: dict[str, int] = {}  # nonce -> its cookie's expiry
        self._attempts: dict[str, deque[float]] = {}  # client address -> attempt times

    def issue(self, token: str) -> str:
        expires = math.ceil(self._clock() + self.ttl_s)
        nonce = secrets.token_urlsafe(16)
        return f"{expires}.{nonce}.{_mac(token, expires, nonce)}"

    def valid(self, token: str, cookie: str | None) -> bool:
        parsed = self._parse(token, cookie)
        return parsed is not None and parsed[1] not in self._revoked

    def revoke(self, token: str, cookie: str | None) -> None:
        """End the session `cookie` names (a sign-out); nothing for a cookie that is not one."""
        parsed = self._parse(token, cookie)
        if parsed is None:
            return
        now = self._clock()
        self._revoked = {n: e for n, e in self._revoked.items() if e > now}
        while len(self._revoked) >= MAX_REVOKED:  # expired first, then the soonest to expire
            del self._revoked[min(self._revoked, key=self._revoked.__getitem__)]
        expires, nonce = parsed
        self._revoked[nonce] = expires

    def retry_after(self, client: str) -> int:
        """0 when `client` may try to sign in now (the try is counted), else the seconds until it
        may."""
        now = self._clock()
        times = self._attempts.get(client)
        if times is None:
            if len(self._attempts) >= MAX_CLIENTS:
                self._forget_idle(now)
            times = self._attempts[client] = deque()
        while times and times[0] <= now - 60:
            times.popleft()
        if len(times) >= self.attempts_per_min:
            return max(1, math.ceil(times[0] + 60 - now))
        times.append(now)
        return 0

    def _forget_idle(self, now: float) -> None:
        self._attempts = {c: t for c, t in self._attempts.items() if t and t[-1] > now - 60}
        if len(self._attempts) >= MAX_CLIENTS:  # a minute of that many addresses: start over
            self._attempts.clear()

    def _parse(self, token: str, cookie: str | None) -> tuple[int, str] | None:
        """(expiry, nonce) of a well-formed, authentic, unexpired cookie; else None."""
        if not isinstance(cookie, str) or cookie.count(".") != 2:
            return None
        expires, nonce, mac = cookie.split(".")
        if not expires.isdigit() or len(expires) > 12:
            return None
        if not hmac.compare_digest(_mac(token, int(expires), nonce).encode(),
                                   mac.encode("utf-8", "surrogatepass")):
            return None
        if int(expires) <= self._clock():
            return None
        return int(expires), nonce
