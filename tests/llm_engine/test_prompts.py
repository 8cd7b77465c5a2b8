"""Chat rendering with tools (llm_engine.prompts) and the streamed split of a tool call's text
(llm_engine.grammar.ToolCallSplitter)."""

from __future__ import annotations

import json

import pytest

from llm_engine.grammar import ToolCallSplitter
from llm_engine.prompts import as_text_messages, knows_tools, render_chat

ORDER = {"type": "function", "function": {"name": "lookup_order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string"}}}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where is 48213?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "lookup_order", "arguments": '{"order_id": "48213"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"status": "shipped"}'},
]


def test_a_template_without_tools_gets_calls_and_results_as_text():
    messages = as_text_messages(CONVERSATION, [ORDER])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call these tools:")
    assert json.dumps(ORDER["function"]) in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>{"name": "lookup_order", "arguments": {"order_id": "48213"}}</tool_call>')
    assert messages[3]["content"] == 'Result of lookup_order: {"status": "shipped"}'


def test_without_tools_the_system_message_is_unchanged():
    assert as_text_messages(CONVERSATION[:2]) == CONVERSATION[:2]


def test_a_template_that_knows_tools_renders_them_itself(tokenizer):
    template = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments.order_id }}{% endfor %}"
        "{% endfor %}")
    try:
        assert knows_tools(tokenizer)
        text = render_chat(tokenizer, CONVERSATION, [ORDER])
    finally:
        tokenizer.chat_template = template
    # The arguments reach the template as a mapping, the result under the tool role.
    assert text == ('[tool lookup_order]<system>Be brief.<user>Where is 48213?<assistant>48213'
                    '<tool>{"status": "shipped"}')


@pytest.mark.parametrize("pieces", [
    ["Let me check. ", "<tool_call>", '{"name": "x", "arguments": {}}', "</tool_call>"],
    ["Let me check. <", "tool", "_c", 'all>{"name": "x", "arguments": {}}</tool_call>'],
    ["Let me check. <tool_call>{", '"name": "x", "arguments": {}}</tool_', "call>"],
])
def test_the_splitter_never_lets_any_of_the_call_through(pieces):
    splitter = ToolCallSplitter()
    spoken = "".join(splitter.feed(piece) for piece in pieces) + splitter.flush()
    assert spoken == "Let me check. "
    assert splitter.call == {"name": "x", "arguments": {}}


def test_text_that_only_looked_like_a_call_is_spoken_in_the_end():
    splitter = ToolCallSplitter()
    spoken = splitter.feed("a < b and <tool") + splitter.feed("s>") + splitter.feed(" ok <t")
    assert spoken + splitter.flush() == "a < b and <tools> ok <t"
    assert splitter.call is None
