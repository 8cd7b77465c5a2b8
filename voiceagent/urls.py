"""URLs as they may be shown: in messages, logs, `/healthz` and the dashboard, never a password."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit


def redact(url: str) -> str:
    """The URL without its password (in the user part or as a `password` parameter; or a
    key=value conninfo's `password`)."""
    if "://" not in url:
        return re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", url)
    try:
        parts = urlsplit(url)
    except ValueError:  # malformed (e.g. an unclosed IPv6 bracket): hide all before the host
        return re.sub(r"://[^@]*@", "://***@", url)
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:***@{host}"
    query = urlencode([(k, "***" if k == "password" else v)
                       for k, v in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))
