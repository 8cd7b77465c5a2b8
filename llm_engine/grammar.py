"""Constrained decoding: a request's output held to a grammar (a JSON schema, or tool calls),
parsed by xgrammar (the library vLLM and SGLang use).

Speculation verifies K + 1 positions in one forward, and each position's mask depends on the
draft tokens before it, so a logits processor run once per token does not fit. `GrammarState`
walks its matcher through the draft, filling one mask row per position (the frontier); the engine
sets the target's logits outside each row to -inf before verifying as usual, then `commit` rolls
the matcher back to the accepted drafts and accepts the recovered or bonus token. Model drafts are
sampled under the same rows (`proposers.base.DraftBuilder`), so q is masked exactly as p is and
verification stays exactly lossless with respect to the masked target: speculative sampling is
lossless for any pair p, q, and a masked target is just another p.

Forced continuations (a key, a bracket, the only tool name, the EOS after a closed value) cost no
model: `forced` drafts them for the `grammar` proposer.

JSON is held to its canonical layout (`", "` and `": "`, no other whitespace): separators and keys
are then forced too, and a weak model cannot spend its budget on whitespace.

How a constrained request ends: the engine's EOS tokens are allowed only where the output is
complete, and nothing else is allowed after a complete JSON value or tool call, so the request
finishes 'eos' when its grammar is done (a tool call ends the turn). A request whose budget runs
out first finishes 'length' with an unfinished value: the caller treats it as no call
(`parse_tool_call` returns None for it).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Collection

import torch
import xgrammar as xgr
from xgrammar.structural_tag import (
    AnyTextFormat,
    GrammarFormat,
    OrFormat,
    StructuralTag,
    TagFormat,
    TriggeredTagsFormat,
)

from llm_engine.config import GrammarSpec

TOOL_CALL_BEGIN, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_BEGIN) + r"(.*)" + re.escape(TOOL_CALL_END), re.S)
_BITS = torch.arange(32, dtype=torch.int32)  # [32], to unpack xgrammar's int32 bitmask words


def tool_functions(spec: GrammarSpec) -> list[dict]:
    """The tools' function dicts ({"name", "parameters", ...}), OpenAI wrapper or not."""
    return [tool.get("function", tool) for tool in spec.tools]


def parse_tool_call(text: str) -> dict | None:
    """The {"name", "arguments"} of the tool call in a 'tools' request's output, or None: no call,
    or one cut off by the budget."""
    match = _TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    return call if isinstance(call, dict) else None


class ToolCallSplitter:
    """A 'tools' request's streamed text split into what may be spoken and the tool call: text
    that could be the start of `<tool_call>` is held back until it is known not to be."""

    def __init__(self) -> None:
        self._held = ""
        self.call_text: str | None = None  # from `<tool_call>` on, once it appeared

    def feed(self, text: str) -> str:
        """The part of `text` (with what was held) that is plain text for sure."""
        if self.call_text is not None:
            self.call_text += text
            return ""
        text, self._held = self._held + text, ""
        at = text.find(TOOL_CALL_BEGIN)
        if at >= 0:
            self.call_text = text[at:]
            return text[:at]
        for size in range(min(len(TOOL_CALL_BEGIN) - 1, len(text)), 0, -1):
            if TOOL_CALL_BEGIN.startswith(text[-size:]):
                text, self._held = text[:-size], text[-size:]
                break
        return text

    def flush(self) -> str:
        """At the end: held text that never became a call."""
        held, self._held = self._held, ""
        return held

    @property
    def call(self) -> dict | None:
        return parse_tool_call(self.call_text) if self.call_text else None


def check_spec(spec: GrammarSpec) -> None:
    """Raise ValueError naming what xgrammar cannot take in the spec's schemas (no tokenizer
    needed: for refusing a request up front)."""
    schemas = ([spec.json_schema] if spec.kind == "json_schema" else
               [f.get("parameters") or {"type": "object"} for f in tool_functions(spec)])
    for schema in schemas:
        try:
            _canonical_json(schema)
        except RuntimeError as exc:
            raise ValueError(f"unsupported schema: {_reason(exc)}") from None


def _reason(exc: RuntimeError) -> str:
    # xgrammar's messages start with a time stamp and its C++ source location.
    return str(exc).strip().splitlines()[-1].split(": ", 1)[-1]


def _canonical_json(schema: dict) -> str:
    # The schema as an EBNF grammar in the canonical layout (see the module doc).
    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))


def _tools_tag(spec: GrammarSpec) -> StructuralTag:
    """Free text until `<tool_call>` (none when the call is required), then one call of a listed
    tool, then only EOS. The free text never holds `spec.exclude`."""
    tags = []
    for function in tool_functions(spec):
        params = function.get("parameters") or {"type": "object", "properties": {}}
        begin = f'{TOOL_CALL_BEGIN}{{"name": {json.dumps(function["name"])}, "arguments": '
        tags.append(TagFormat(begin=begin, content=GrammarFormat(grammar=_canonical_json(params)),
                              end="}" + TOOL_CALL_END))
    if spec.tool_choice == "none":
        return StructuralTag(format=AnyTextFormat(excludes=[TOOL_CALL_BEGIN, *spec.exclude]))
    if spec.tool_choice == "required":
        return StructuralTag(format=OrFormat(elements=tags))
    return StructuralTag(format=TriggeredTagsFormat(
        triggers=[TOOL_CALL_BEGIN], tags=tags, stop_after_first=True, excludes=spec.exclude))


def _key(spec: GrammarSpec) -> str:
    return json.dumps([spec.kind, spec.json_schema, spec.tools, spec.tool_choice, spec.exclude],
                      sort_keys=True)


class GrammarCache:
    """One per engine: xgrammar's view of the tokenizer, its compiler, and the grammars compiled
    last (compiling takes milliseconds to seconds with a real vocabulary; a voice agent sends
    the same tool list every turn)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Collection[int], size: int = 32):
        self.tokenizer, self.vocab_size, self.size = tokenizer, vocab_size, size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # the LRU below bounds it
        self._compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # requests start on the callers' threads

    def __len__(self) -> int:
        return len(self._compiled)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        key = _key(spec)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        try:
            if spec.kind == "json_schema":
                compiled = self.compiler.compile_json_schema(
                    json.dumps(spec.json_schema), any_whitespace=False)
            else:
                compiled = self.compiler.compile_structural_tag(_tools_tag(spec))
        except RuntimeError as exc:  # xgrammar's word for a schema it cannot take
            raise ValueError(f"unsupported schema: {_reason(exc)}") from None
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        return compiled

    def new_state(self, spec: GrammarSpec, max_rows: int) -> GrammarState:
        return GrammarState(self.compile(spec), self.tokenizer, self.vocab_size, max_rows)


class GrammarState:
    """A request's matcher at its committed tokens plus a speculative frontier of draft tokens.

    Mask row i is the mask before frontier token i (row 0: the next committed position); rows
    are filled as the frontier grows, so drafting under the mask and verifying share them.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, tokenizer, vocab_size: int, max_rows: int):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)  # [max_rows, words]
        self._frontier: list[int] = []  # draft tokens accepted past the committed ones
        self._filled = 0  # mask rows filled: rows 0 .. _filled - 1

    @property
    def frontier(self) -> list[int]:
        return list(self._frontier)

    @property
    def done(self) -> bool:
        """The matcher accepted a stop token: the output is complete."""
        return self.matcher.is_terminated()

    def _fill(self) -> None:
        if self._filled > len(self._frontier):
            return
        if self._filled == len(self._bitmask):  # a frontier longer than max_rows: grow
            self._bitmask = torch.cat([self._bitmask, torch.empty_like(self._bitmask)])
        if self.matcher.is_terminated():
            # After EOS: whatever is drawn there is cut by the engine; an all-false row would
            # make the target's row all -inf (NaN probabilities).
            self._bitmask[self._filled] = -1
        else:
            self.matcher.fill_next_token_bitmask(self._bitmask, self._filled)
        self._filled += 1

    def masks(self) -> torch.Tensor:
        """Allowed tokens [len(frontier) + 1, vocab] (bool): one row per verified position."""
        self._fill()
        words = self._bitmask[: self._filled]  # [rows, words]
        bits = (words.unsqueeze(-1) >> _BITS) & 1  # [rows, words, 32]
        return bits.flatten(1)[:, : self.vocab_size].bool()

    def allowed(self) -> torch.Tensor:
        """Allowed tokens [vocab] (bool) at the end of the frontier."""
        return self.masks()[-1]

    def push(self, token: int) -> bool:
        """Accept a draft token onto the frontier; False (nothing changes) if the grammar refuses
        it here."""
        self._fill()
        if self.matcher.is_terminated() or not self.matcher.accept_token(token):
            return False
        self._frontier.append(token)
        return True

    def constrain(self, tokens: list[int]) -> int:
        """Push a draft whose first len(frontier) tokens are already pushed; returns how many of
        its tokens the grammar allows (the draft is cut there: later rows have no mask)."""
        assert tokens[: len(self._frontier)] == self._frontier
        for token in tokens[len(self._frontier) :]:
            if not self.push(token):
                break
        return len(self._frontier)

    def commit(self, num_accepted: int, tokens: list[int]) -> None:
        """After verification: keep the accepted drafts, then accept the rest of the committed
        `tokens` (the recovered or bonus token), which the masked target chose."""
        self.matcher.rollback(len(self._frontier) - num_accepted)
        self._frontier, self._filled = [], 0
        for token in tokens[num_accepted:]:
            if self.matcher.is_terminated():
                return  # tokens after EOS: the engine drops them
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"token {token} outside the grammar was committed")

    def forced(self, k: int) -> list[int]:
        """Push and return up to k tokens the grammar leaves no choice about: the tokenizer's
        encoding of xgrammar's forced string (the target's own tokenisation of it), or else
        xgrammar's tokens for it, or else the only allowed token (EOS after a closed value)."""
        start = len(self._frontier)
        while (room := k - (len(self._frontier) - start)) > 0 and not self.done:
            text = self.matcher.find_jump_forward_string()
            encoded = self.tokenizer.encode(text, add_special_tokens=False) if text else []
            if self._push_some(encoded, room) or self._push_some(
                    self.matcher.find_jump_forward_tokens(), room):
                continue
            only = self.allowed().nonzero()
            if len(only) != 1 or not self.push(int(only[0])):
                break
        return self._frontier[start:]

    def _push_some(self, tokens: list[int], room: int) -> int:
        pushed = 0
        for token in tokens[:room]:
            if not self.push(token):
                break
            pushed += 1
        return pushed
