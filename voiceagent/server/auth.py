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

WS_SCHEME = {"https": "wss", "http": "ws"}  # Twilio signs the wss:// URL of <Stream url>


def presented_token(conn: HTTPConnection, extra: object = None) -> object:
    auth = conn.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return conn.query_params.get("token") or extra


def token_ok(expected: str | None, presented: object) -> bool:
    if not expected:
        return True
    return isinstance(presented, str) and hmac.compare_digest(
        expected.encode(), presented.encode())


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
