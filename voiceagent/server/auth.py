"""Who may start a call: the shared token, and Twilio's request signature.

The token (config `server.token` or env VOICEAGENT_TOKEN) is read from `Authorization: Bearer`,
a `token` query parameter, or, for Twilio, the stream's `customParameters.token`: Twilio's
`<Stream>` URL may not carry a query string, so TwiML passes it as a `<Parameter>`.

Twilio signs the WebSocket upgrade with X-Twilio-Signature, an HMAC of the URL it requested under
the account's auth token (https://www.twilio.com/docs/usage/security); twilio's RequestValidator
checks it. Behind a proxy the URL we see is not the one Twilio used, so `server.public_url`
names it.
"""

from __future__ import annotations

import hmac

from starlette.requests import HTTPConnection
from twilio.request_validator import RequestValidator


def presented_token(conn: HTTPConnection, extra: str | None = None) -> str | None:
    auth = conn.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return conn.query_params.get("token") or extra


def token_ok(expected: str | None, presented: str | None) -> bool:
    if not expected:
        return True
    return presented is not None and hmac.compare_digest(expected.encode(), presented.encode())


def public_url(conn: HTTPConnection, base: str | None) -> str:
    """The URL the peer requested, as it saw it (scheme and host from the proxy when set)."""
    path = conn.url.path + (f"?{conn.url.query}" if conn.url.query else "")
    if base:
        return base.rstrip("/") + path
    proto = conn.headers.get("x-forwarded-proto", conn.url.scheme)
    scheme = {"https": "wss", "http": "ws"}.get(proto, proto)
    host = conn.headers.get("x-forwarded-host") or conn.headers.get("host", conn.url.netloc)
    return f"{scheme}://{host}{path}"


def twilio_signature_ok(conn: HTTPConnection, auth_token: str | None, base: str | None) -> bool:
    if not auth_token:
        return True
    signature = conn.headers.get("x-twilio-signature")
    if not signature:
        return False
    return RequestValidator(auth_token).validate(public_url(conn, base), {}, signature)
