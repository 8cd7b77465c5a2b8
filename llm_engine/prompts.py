"""Chat messages -> prompt token ids, through the target's own chat template.

Messages are OpenAI-shaped: an assistant message may carry `tool_calls` (arguments as a JSON
string or a dict) and a `tool` message answers one by `tool_call_id`. A template that knows tools
(Qwen2.5, Llama 3.1: it mentions `tool_calls`) renders them itself, with the tool list. One that
does not (SmolLM2) gets them as text it has seen: the tool list and the call format in the system
message, each call as the `<tool_call>{...}</tool_call>` text a constrained request produces
(`llm_engine.grammar`), and each result as a user message naming the tool.
"""

from __future__ import annotations

import json
from typing import Any

from llm_engine.grammar import TOOL_CALL_BEGIN, TOOL_CALL_END


def encode_chat(tokenizer, messages: list[dict[str, Any]],
                tools: list[dict] | None = None) -> list[int]:
    """Render with the generation prompt, then tokenise without adding specials twice. `tools`:
    OpenAI function tools the model may call."""
    return tokenizer.encode(render_chat(tokenizer, messages, tools), add_special_tokens=False)


def render_chat(tokenizer, messages: list[dict[str, Any]],
                tools: list[dict] | None = None) -> str:
    if knows_tools(tokenizer):
        return tokenizer.apply_chat_template(
            [_native(m) for m in messages], tools=tools or None, add_generation_prompt=True,
            tokenize=False)
    return tokenizer.apply_chat_template(
        as_text_messages(messages, tools), add_generation_prompt=True, tokenize=False)


def knows_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tool_calls" in template


def tool_call_text(name: str, arguments: dict | str) -> str:
    """One call as a constrained request writes it (canonical JSON layout)."""
    return (TOOL_CALL_BEGIN + json.dumps({"name": name, "arguments": _arguments(arguments)})
            + TOOL_CALL_END)


def tools_instructions(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    return ("You can call these tools:\n" + lines + "\nTo call one, reply with "
            + tool_call_text("<name>", {"<argument>": "<value>"})
            + " and nothing after it. Then answer the caller from its result.")


def as_text_messages(messages: list[dict[str, Any]],
                     tools: list[dict] | None = None) -> list[dict[str, str]]:
    """Tool calls and results as plain system / user / assistant text (module doc)."""
    names: dict[str, str] = {}  # tool_call_id -> the tool's name
    out: list[dict[str, str]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = call.get("function", call)
                names[call.get("id", "")] = function["name"]
                calls.append(tool_call_text(function["name"], function.get("arguments") or {}))
            out.append({"role": "assistant", "content": content + "".join(calls)})
        elif role == "tool":
            name = names.get(message.get("tool_call_id", ""), "the tool")
            out.append({"role": "user", "content": f"Result of {name}: {content}"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        instructions = tools_instructions(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def _native(message: dict[str, Any]) -> dict[str, Any]:
    # HF templates take a call's arguments as a mapping (they apply `tojson`).
    if message.get("role") != "assistant" or not message.get("tool_calls"):
        return message
    calls = [{**call, "function": {**call["function"],
                                   "arguments": _arguments(call["function"].get("arguments"))}}
             for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _arguments(arguments: dict | str | None) -> dict:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) else {}
