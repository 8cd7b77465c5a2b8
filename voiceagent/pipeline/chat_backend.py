"""What the pipeline's LLM service talks to: chat messages in, a request handle out.

Two backends: the in-process engine (`EngineChat`, the default) and a remote OpenAI-compatible
server (`voiceagent.pipeline.remote_llm.RemoteChat`). Both hand back a handle that streams
`TextDelta`s, cancels, and ends in a `Completion` whose `RequestStats` the clocks read, so the
clocks, the dashboard and the benchmarks are the same whichever generates.

Tools: with a `ToolUse`, the model may answer with a tool call instead of (or after) text. The
engine decodes under the tools grammar (`llm_engine.grammar`), a remote server gets OpenAI's
`tools` and `tool_choice`; either way the handle streams only the text and the `Completion`
carries the call in `tool_calls`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from llm_engine.config import GrammarSpec, SamplingConfig
from llm_engine.prompts import encode_chat
from llm_engine.serving import Completion, EngineWorker, TextDelta


def grammar_method(method: str) -> str:
    """Under a grammar, the forced tokens (a call's keys, brackets, the tool's name) are drafted
    without a model, combined with the configured method elsewhere: lossless, and most of a call
    costs no forward of its own."""
    if method.startswith("grammar"):
        return method
    return "grammar" if method == "off" else f"grammar+{method}"


class ChatHandle(Protocol):
    """One request in flight (`llm_engine.serving.RequestHandle` is one)."""

    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[TextDelta]: ...

    async def result(self) -> Completion: ...


@dataclass(frozen=True)
class ToolUse:
    """The tools a request may call: all of them are shown to the model (the prompt stays the
    same from turn to turn, so its KV is reused); `required` narrows the reply to a call of one
    of those names."""

    tools: list[dict]  # OpenAI function tools
    required: tuple[str, ...] = ()
    allowed: bool = True  # False: the reply must not call any (the turn's calls are used up)
    exclude: tuple[str, ...] = ()  # its words never hold these (in-process engine only)

    def choices(self) -> list[dict]:
        """The tools the reply may call."""
        if not self.required:
            return self.tools
        return [t for t in self.tools if t["function"]["name"] in self.required]

    @property
    def choice(self) -> str:
        return "none" if not self.allowed else "required" if self.required else "auto"

    def grammar(self) -> GrammarSpec:
        """The engine's grammar for the reply (`llm_engine.grammar`)."""
        return GrammarSpec(kind="tools", tools=self.choices(), tool_choice=self.choice,
                           exclude=list(self.exclude))


class ChatBackend(Protocol):
    model: str  # what the service reports as its model
    name: str  # the default method label of its requests (engine: its speculation method)

    def submit(self, messages: list[dict[str, Any]], sampling: SamplingConfig | None,
               session_id: str, method: str | None, tools: ToolUse | None = None,
               prefill: bool = False) -> ChatHandle:
        """Start a request; raises ValueError for a prompt the backend refuses. `prefill`: a
        one-token request that only leaves `messages` in the session's cache, which a later
        request of the session may take the place of."""

    def drop_session(self, session_id: str) -> None:
        """The call is over: forget its prefix cache."""


@dataclass
class EngineChat:
    """The in-process engine: the chat template applied here, KV reused per call session."""

    worker: EngineWorker
    tokenizer: Any

    @property
    def model(self) -> str:
        return self.worker.engine.config.target

    @property
    def name(self) -> str:
        return self.worker.engine.config.speculation.method

    def submit(self, messages: list[dict[str, Any]], sampling: SamplingConfig | None,
               session_id: str, method: str | None, tools: ToolUse | None = None,
               prefill: bool = False) -> ChatHandle:
        prompt = encode_chat(self.tokenizer, messages, tools.tools if tools else None)
        if tools is not None and (sampling is None or sampling.max_new_tokens > 1):
            sampling = replace(sampling or self.worker.engine.config.sampling,
                               grammar=tools.grammar())
        # Draft through the grammar where its output is mostly forced: a required call, or a
        # JSON response. A reply that may be words keeps its method (and its dashboard label).
        forced = tools.required if tools is not None else sampling and sampling.grammar
        if forced:
            method = grammar_method(method or self.name)
        return self.worker.submit(prompt, sampling, session_id, method, prefill)

    def drop_session(self, session_id: str) -> None:
        self.worker.engine.drop_session(session_id)

    def prepare_tools(self, uses: list[ToolUse]) -> None:
        """Compile the grammars of these tool uses now, not on a call's event loop."""
        self.worker.engine.compile_grammars([use.grammar() for use in uses])
