"""Property-based fuzzing of the Twilio Media Streams checks: whatever arrives, the parser either
accepts it or refuses it with one of the documented close codes, and never raises anything else
(which would kill the connection's handler without a reason)."""

from __future__ import annotations

import base64
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from voiceagent.server.media_streams import (
    EVENTS,
    ProtocolViolation,
    check_in_call,
    parse,
    parse_start,
)

DOCUMENTED = {1002, 1003, 1007, 1009}
SID = "MZfuzz"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
# Messages shaped like Twilio's, with any of their fields replaced by anything.
messages = st.fixed_dictionaries(
    {"event": st.sampled_from(sorted(EVENTS)) | st.text()},
    optional={
        "streamSid": st.just(SID) | json_values,
        "media": st.fixed_dictionaries({}, optional={
            "payload": st.binary(max_size=400).map(lambda b: base64.b64encode(b).decode())
            | json_values}) | json_values,
        "start": st.fixed_dictionaries({}, optional={
            "streamSid": st.just(SID) | json_values,
            "mediaFormat": st.just({"encoding": "audio/x-mulaw", "sampleRate": 8000,
                                    "channels": 1}) | json_values,
            "customParameters": json_values}) | json_values,
        "mark": json_values, "dtmf": json_values,
    },
)


def _checked(raw: dict) -> None:
    try:
        message = parse(raw, 4096)
        if message["event"] == "start":
            parse_start(message)
        else:
            check_in_call(message, SID, 1600)
    except ProtocolViolation as v:
        assert v.code in DOCUMENTED and v.reason


@settings(max_examples=400, deadline=None)
@given(messages)
def test_any_twilio_shaped_message_is_accepted_or_refused_with_a_documented_code(message):
    _checked({"type": "websocket.receive", "text": json.dumps(message)})


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=600) | st.binary(max_size=200))
def test_any_frame_at_all_is_accepted_or_refused_with_a_documented_code(frame):
    key = "bytes" if isinstance(frame, bytes) else "text"
    _checked({"type": "websocket.receive", key: frame})


def test_json_nested_deeper_than_python_recurses_is_1007():
    deep = "[" * 60_000 + "]" * 60_000  # under the size limit, over the recursion limit
    try:
        parse({"type": "websocket.receive", "text": deep}, 1 << 20)
    except ProtocolViolation as v:
        assert (v.code, v.reason) == (1007, "message is not JSON")
    else:
        raise AssertionError("accepted")
