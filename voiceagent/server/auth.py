"""Who may use the server: the shared token, a session cookie for the pages, Twilio's signature.

The token (config `server.token` or env VOICEAGENT_TOKEN) is read from `Authorization: Bearer`,
or, for Twilio, the stream's `customParameters.token`: Twilio's `<Stream>` URL may not carry a
query string, so TwiML passes it as a `<Parameter>`. It is never read from a URL: URLs end up in
access logs and browser history. The pages trade it once (`POST /api/session`) for an HttpOnly,
SameSite=Strict cookie that never holds the token and expires (`voiceagent.server.sessions`),
and that their fetches, EventSource and WebSocket requests then carry.

Twilio signs the WebSocket upgrade with X-Twilio-Signature, an HMAC of the URL it requested under
the account's auth token (https://www.twilio.com/docs/usage/security); twilio's RequestValidator
checks it. Behind a proxy the URL we see is not the one Twilio used, so `server.public_url`
names it.
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import HTTPException, Request
from starlette.requests import HTTPConnection
from twilio.request_validator import RequestValidator

WS_SCHEME = {"https": "wss", "http": "ws"}  # Twilio signs the wss:// URL of <Stream url>
SESSION_COOKIE = "voiceagent_session"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_public(server) -> bool:
    """Reachable from elsewhere: bound off loopback, or published (`public_url`: a tunnel or
    proxy forwards to the loopback port)."""
    return not is_loopback(server.host) or bool(server.public_url)


def _bytes(value: str) -> bytes:
    # A lone surrogate (JSON allows "\ud800") cannot be UTF-8: it must not match, nor raise.
    return value.encode("utf-8", "surrogatepass")


def presented_token(conn: HTTPConnection, extra: object = None) -> object:
    auth = conn.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return extra


def token_ok(expected: str | None, presented: object) -> bool:
    if not expected:
        return True
    return isinstance(presented, str) and hmac.compare_digest(_bytes(expected), _bytes(presented))


def authorized(conn: HTTPConnection, expected: str | None, extra: object = None) -> bool:
    """The bearer token (or `extra`) when one is presented, else the session cookie."""
    if not expected:
        return True
    presented = presented_token(conn, extra)
    if presented is not None:
        return token_ok(expected, presented)
    return conn.app.state.server.sessions.valid(expected, conn.cookies.get(SESSION_COOKIE))


def require_token(request: Request) -> None:
    """A route dependency: 401 unless the request carries the server's token (or its session)."""
    if not authorized(request, request.app.state.server.cfg.server.token):
        raise HTTPException(401, "unauthorized: missing or wrong token")


def public_url(conn: HTTPConnection, base: str | None) -> str:
    """The WebSocket URL the peer requested, as it saw it: `base` (https://host or wss://host)
    when set, else the proxy's forwarded scheme and host, else ours."""
    path = conn.url.path + (f"?{conn.url.query}" if conn.url.query else "")
    if base:
        scheme, _, rest = base.rstrip("/").partition("://")
        return f"{WS_SCHEME.get(scheme, scheme)}://{rest}{path}"
    proto = conn.headers.get("x-forwarded-proto", conn.url.scheme)
    host = conn.headers.get("x-forwarded-host") or conn.headers.get("host", conn.url.netloc)
    return f"{WS_SCHEME.get(proto, proto)}://{host}{path}"


def twilio_signature_ok(conn: HTTPConnection, auth_token: str | None, base: str | None) -> bool:
    if not auth_token:
        return True
    signature = conn.headers.get("x-twilio-signature")
    if not signature:
        return False
    return RequestValidator(auth_token).validate(public_url(conn, base), {}, signature)
