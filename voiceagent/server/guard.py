"""Requests from the wrong place are refused before any route sees them.

- Host: only the configured names (DNS rebinding: a web page on evil.example that resolves its
  name to 127.0.0.1 would otherwise reach a loopback server from the operator's own browser).
- Origin: a browser request (fetch, EventSource, WebSocket) from a page of another origin is
  refused, unless `server.allowed_origins` names it. Clients that are not browsers (Twilio, curl)
  send no Origin and pass.
- Proxied: a request that a reverse proxy forwarded (X-Forwarded-*, Forwarded) is refused by a
  server without a token (unless `allow_public_without_token`): a proxy makes it public.

Refusals: HTTP 400 (host) or 403 (origin, proxied) with a JSON `detail`; a WebSocket is refused
at its handshake (HTTP 403). The access log never shows a `token=` query value.
"""

from __future__ import annotations

import json
import logging
import re
from urllib.parse import urlsplit

from fastapi import HTTPException, Request
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from voiceagent.config import ServerConfig
from voiceagent.server.auth import LOOPBACK_NAMES, is_loopback

ALL_INTERFACES = ("0.0.0.0", "::", "")


def host_name(host: str) -> str:
    """'[::1]:7860' -> '::1', 'Example.com:80' -> 'example.com'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def allowed_hosts(cfg: ServerConfig) -> set[str] | None:
    """Host names to accept; None: any (a server bound to every interface, guarded by its
    token, or `allowed_hosts: ["*"]`)."""
    if cfg.allowed_hosts:
        names = {host_name(h) for h in cfg.allowed_hosts}
        return None if "*" in names else names
    if cfg.host in ALL_INTERFACES:
        return None
    names = {host_name(cfg.host)}
    if is_loopback(cfg.host):
        names |= set(LOOPBACK_NAMES)
    if cfg.public_url:
        names.add(host_name(urlsplit(cfg.public_url).netloc))
    return names


# What proxies add (nginx adds none of its own accord, so a bare `proxy_pass` passes: a
# heuristic, not a wall).
FORWARDED = ("x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-forwarded-port",
             "forwarded", "x-real-ip", "via")


class HostOriginGuard:
    def __init__(self, app: ASGIApp, cfg: ServerConfig):
        self.app = app
        self.hosts = allowed_hosts(cfg)
        self.origins = {o.rstrip("/").lower() for o in cfg.allowed_origins}
        if cfg.public_url:
            self.origins.add(_origin(cfg.public_url))
        # A loopback server without a token counts on nobody else reaching it; a reverse proxy
        # in front would hand it to the world.
        self.refuse_proxied = not (cfg.token or cfg.allow_public_without_token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if self.hosts is not None and host_name(host) not in self.hosts:
            return await _refuse(scope, receive, send, 400, f"host {host[:64]!r} not allowed")
        if self.refuse_proxied and any(h in headers for h in FORWARDED):
            return await _refuse(scope, receive, send, 403, "a proxy forwarded this request, but "
                                 "this server has no token: set server.token and "
                                 "server.public_url for a proxied deployment")
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, headers):
            return await _refuse(scope, receive, send, 403, f"origin {origin[:64]!r} not allowed")
        return await self.app(scope, receive, send)

    def _origin_ok(self, origin: str, headers: Headers) -> bool:
        origin = origin.rstrip("/").lower()
        if origin in self.origins:
            return True
        # Same origin: the page was served by this host (as the browser, or a proxy, named it).
        netloc = urlsplit(origin).netloc
        return bool(netloc) and netloc in {
            h.lower() for h in (headers.get("host"), headers.get("x-forwarded-host")) if h}


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, reason: str) -> None:
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008, "reason": reason})
        return
    await JSONResponse({"detail": reason}, status)(scope, receive, send)


async def json_object(request: Request, limit: int) -> dict:
    """The request's body as a JSON object, read up to `limit` bytes (413 beyond, 400 if not
    an object)."""
    body = bytearray()
    async for chunk in request.stream():  # chunked bodies have no Content-Length to trust
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"request too big: over {limit} bytes")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise HTTPException(400, "body is not JSON") from None
    if not isinstance(data, dict):
        raise HTTPException(400, "body must be a JSON object")
    return data


TOKEN_IN_QUERY = re.compile(r"(?i)([?&](?:token|access_token)=)[^&\s\"]*")


class RedactTokens(logging.Filter):
    """Access-log lines with `token=<value>` in a URL show `token=***` instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(TOKEN_IN_QUERY.sub(r"\1***", a) if isinstance(a, str) else a
                                for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = TOKEN_IN_QUERY.sub(r"\1***", record.msg)
        return True


def redact_access_log() -> None:
    log = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactTokens) for f in log.filters):
        log.addFilter(RedactTokens())
