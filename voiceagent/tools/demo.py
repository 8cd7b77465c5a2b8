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
    order = _orders().get(order_id)
    return {"order_id": order_id, **order} if order else {"order_id": order_id, "found": False}


async def end_call(reason: str = "caller is done") -> dict:
    return {"ending": True, "reason": reason}


# Strings are bounded by patterns: under the tools grammar the model can only write what they allow
# (five digits for an order, not "4 8 2 1 3" or a made-up word).
TOOLS = [
    {"name": "current_time", "description": "The current time and date.",
     "parameters": {"type": "object", "properties": {
         "timezone": {"type": "string", "pattern": "^[A-Za-z_/]{1,32}$",
                      "description": "IANA zone, e.g. Europe/Paris"}},
         "additionalProperties": False},
     "handler": "voiceagent.tools.demo:current_time", "read_only": True,
     "say": "It is {time}, {timezone} time.",
     # The time itself, not the time of something ("what time does the pharmacy open").
     "triggers": [r"\btime is it\b", r"\b(the )?(current|exact) time\b",
                  r"\bwhat('s| is) the time\b", r"\btell me the time\b",
                  r"\bwhat (day|date) is (it|today)\b",
                  r"\bwhat('s| is) (the date|today's date)\b"]},
    {"name": "lookup_order", "description": "Look up an order's status by its order number.",
     "parameters": {"type": "object", "properties": {
         "order_id": {"type": "string", "pattern": "^[0-9]{5}$",
                      "description": "the five-digit order number the caller gave"}},
         "required": ["order_id"], "additionalProperties": False},
     "handler": "voiceagent.tools.demo:lookup_order", "read_only": True,
     "say": "Order {order_id!d} is {status}.",
     "triggers": [r"\border\b.*\d|\d.*\border\b"]},
    {"name": "end_call", "description": "Hang up after saying goodbye, when the caller is done.",
     "parameters": {"type": "object", "properties": {
         "reason": {"type": "string", "pattern": "^[A-Za-z ,.']{0,60}$"}},
                    "additionalProperties": False},
     "handler": "voiceagent.tools.demo:end_call", "ends_call": True,
     "triggers": [r"\b(good ?bye|bye|hang up)\b"]},
]
