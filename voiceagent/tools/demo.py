"""The demo tools for the embedded default, with no network: the time, an order lookup over the
bundled orders.json, and `end_call`; the entry `voiceagent.tools.demo` names the set."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

ORDERS = Path(__file__).with_name("orders.json")


@cache
def _orders() -> dict[str, dict]:
    return json.loads(ORDERS.read_text())


async def current_time(timezone: str = "UTC") -> dict:
    try:
        now = datetime.now(ZoneInfo(timezone))
    except (ZoneInfoNotFoundError, ValueError):
        return {"error": f"unknown time zone {timezone!r}"}
    return {"time": now.strftime("%H:%M"), "day": now.strftime("%A %d %B %Y"),
            "timezone": timezone}


async def lookup_order(order_id: str) -> dict:
    # Callers say digits with spaces or dashes ("four eight two one three" is transcribed
    # "4 8 2 1 3" or "48213").
    key = "".join(ch for ch in order_id if ch.isdigit())
    order = _orders().get(key)
    return {"order_id": key, **order} if order else {"order_id": key, "found": False}


async def end_call(reason: str = "caller is done") -> dict:
    return {"ending": True, "reason": reason}


TOOLS = [
    {"name": "current_time", "description": "The current time and date.",
     "parameters": {"type": "object", "properties": {
         "timezone": {"type": "string", "description": "IANA zone, e.g. Europe/Paris"}},
         "additionalProperties": False},
     "handler": "voiceagent.tools.demo:current_time"},
    {"name": "lookup_order", "description": "Look up an order's status by its order number.",
     "parameters": {"type": "object", "properties": {
         "order_id": {"type": "string", "description": "the order number the caller gave"}},
         "required": ["order_id"], "additionalProperties": False},
     "handler": "voiceagent.tools.demo:lookup_order"},
    {"name": "end_call", "description": "Hang up after saying goodbye, when the caller is done.",
     "parameters": {"type": "object", "properties": {"reason": {"type": "string"}},
                    "additionalProperties": False},
     "handler": "voiceagent.tools.demo:end_call", "ends_call": True},
]
