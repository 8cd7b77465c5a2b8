"""Tools: loading the configured entries (clear errors for bad ones), and `Tool.run`, which
checks arguments, bounds the handler's time and turns every failure into a result."""

from __future__ import annotations

import asyncio

import pytest

from voiceagent.tools import ToolError, load_tools, takes_whole_number

DEMO = "voiceagent.tools.demo"


async def _slow(seconds: float) -> dict:
    await asyncio.sleep(seconds)
    return {"slept": seconds}


async def _broken() -> dict:
    raise KeyError("no such row")


def _spec(**change) -> dict:
    return {"name": "slow", "description": "sleeps", "handler": f"{__name__}:_slow",
            "parameters": {"type": "object", "properties": {"seconds": {"type": "number"}},
                           "required": ["seconds"]}, **change}


def test_the_demo_set_loads_with_openai_schemas_and_end_call_ends_the_call():
    tools = {t.name: t for t in load_tools([DEMO])}
    assert set(tools) == {"current_time", "lookup_order", "end_call"}
    assert tools["lookup_order"].schema["function"]["parameters"]["required"] == ["order_id"]
    assert tools["end_call"].ends_call and not tools["lookup_order"].ends_call


@pytest.mark.parametrize("words, called", [
    ("What time is it?", True),
    ("Can you tell me the time please", True),
    ("what's the time in Paris", True),
    ("What is the current time?", True),
    ("What day is it today?", True),
    ("What time does the pharmacy open on Saturday?", False),
    ("What time do you close?", False),
    ("I had a great time, thanks.", False),
])
def test_current_time_is_triggered_by_asking_the_time_not_the_time_of_something(words, called):
    current_time = next(t for t in load_tools([DEMO]) if t.name == "current_time")
    assert current_time.triggered_by(words) is called


async def test_a_template_speaks_a_result_and_leaves_a_missing_field_to_the_model():
    lookup = next(t for t in load_tools([DEMO]) if t.name == "lookup_order")
    assert lookup.read_only
    found = await lookup.run({"order_id": "48213"}, 1.0)
    assert lookup.spoken(found) == "Order 4 8 2 1 3 is shipped."
    missing = await lookup.run({"order_id": "99999"}, 1.0)
    assert missing.ok and lookup.spoken(missing) is None  # no status: the model answers
    refused = await lookup.run({"order_id": "12"}, 1.0)
    assert not refused.ok and lookup.spoken(refused) is None


def test_only_tools_that_change_nothing_are_read_only():
    tools = {t.name: t for t in load_tools([DEMO])}
    assert tools["current_time"].read_only and tools["lookup_order"].read_only
    assert not tools["end_call"].read_only


async def test_an_order_is_found_by_its_five_digits_and_other_forms_are_refused():
    (lookup,) = [t for t in load_tools([DEMO]) if t.name == "lookup_order"]
    found = await lookup.run({"order_id": "48213"}, timeout_s=2)
    missing = await lookup.run({"order_id": "11111"}, timeout_s=2)
    spaced = await lookup.run({"order_id": "4 8 2 1 3"}, timeout_s=2)
    assert found.ok and found.content["status"] == "shipped"
    assert missing.ok and missing.content == {"order_id": "11111", "found": False}
    assert not spaced.ok and "does not match" in spaced.content["error"]


def _number_tool(pattern: str) -> dict:
    return _spec(name="find", triggers=[r"\border\b"], parameters={
        "type": "object", "properties": {"order_id": {"type": "string", "pattern": pattern}}})


@pytest.mark.parametrize("tools, words, digits, whole", [
    ([DEMO], "the order number is 4821-3", "48213", True),  # the five digits an order takes
    ([DEMO], "the order number is 4821", "4821", False),  # four: the caller goes on
    ([DEMO], "my phone number is 48213", "48213", False),  # no tool is asked for
    ([_number_tool("^[0-9]{10}$")], "order 555-123-4567", "5551234567", True),
    ([_number_tool("^[0-9]{3,10}$")], "order 555-123", "555123", False),  # could go on
    ([_number_tool("^[0-9]{3,10}$")], "order 555-123-4567", "5551234567", True),  # its longest
    ([_number_tool("^[1-9]{5,8}$")], "order 48213", "48213", False),  # "482131" is taken too
    ([_number_tool("^[0-9]{4}$")], "order 4111", "4111", False),  # one group: a card goes on
    ([_number_tool("[0-9]{5}")], "order 48213", "48213", False),  # unanchored: longer ones too
])
def test_a_number_is_whole_where_a_triggered_tool_takes_it_and_no_longer_one(
        tools, words, digits, whole):
    assert takes_whole_number(load_tools(tools), words, digits) is whole


@pytest.mark.parametrize("spec,reason", [
    (_spec(handler="voiceagent.tools.demo"), "must be 'package.module:function'"),
    (_spec(handler="voiceagent.tools.demo:nope"), "cannot be imported"),
    (_spec(handler="json:dumps"), "must be an async function"),
    (_spec(name="two words"), "needs a name"),
    (_spec(parameters={"type": "array"}), "must be a JSON schema of type object"),
    (_spec(parameters={"type": 7}), "not a JSON schema"),
    ("voiceagent.nope", "cannot import"),
    ("json", "has no TOOLS list"),
])
def test_a_bad_entry_is_refused_naming_it(spec, reason):
    with pytest.raises(ToolError, match=reason):
        load_tools([spec])


def test_two_tools_of_one_name_are_refused():
    with pytest.raises(ToolError, match="more than one tool named slow"):
        load_tools([_spec(), _spec()])


@pytest.mark.parametrize("arguments,timeout_s,handler,error", [
    ({"seconds": "soon"}, 2, "_slow", "bad arguments: 'soon' is not of type 'number'"),
    ({"seconds": 5}, 0.1, "_slow", "slow took longer than 0.1 s"),
    ({}, 2, "_broken", "slow failed: KeyError"),
])
async def test_a_failing_call_becomes_a_result_that_says_why(arguments, timeout_s, handler,
                                                             error):
    spec = _spec(handler=f"{__name__}:{handler}")
    if handler == "_broken":
        spec["parameters"] = {"type": "object", "properties": {}}
    (tool,) = load_tools([spec])
    result = await tool.run(arguments, timeout_s)
    assert not result.ok and result.content["error"].startswith(error)
    assert result.duration_ms < 2000
