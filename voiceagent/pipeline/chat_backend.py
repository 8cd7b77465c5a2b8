"""What the pipeline's LLM service talks to: chat messages in, a request handle out.

Two backends: the in-process engine (`EngineChat`, the default) and a remote OpenAI-compatible
server (`voiceagent.pipeline.remote_llm.RemoteChat`). Both hand back a handle that streams
`TextDelta`s, cancels, and ends in a `Completion` whose `RequestStats` the clocks read, so the
clocks, the dashboard and the benchmarks are the same whichever generates.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from llm_engine.config import SamplingConfig
from llm_engine.prompts import encode_chat
from llm_engine.serving import AsyncEngine, Completion, TextDelta


class ChatHandle(Protocol):
    """One request in flight (`llm_engine.serving.RequestHandle` is one)."""

    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[TextDelta]: ...

    async def result(self) -> Completion: ...


class ChatBackend(Protocol):
    model: str  # what the service reports as its model
    name: str  # the default method label of its requests (engine: its speculation method)

    def submit(self, messages: list[dict[str, str]], sampling: SamplingConfig | None,
               session_id: str, method: str | None) -> ChatHandle:
        """Start a request; raises ValueError for a prompt the backend refuses."""

    def drop_session(self, session_id: str) -> None:
        """The call is over: forget its prefix cache."""


@dataclass
class EngineChat:
    """The in-process engine: the chat template applied here, KV reused per call session."""

    engine: AsyncEngine
    tokenizer: Any

    @property
    def model(self) -> str:
        return self.engine.engine.config.target

    @property
    def name(self) -> str:
        return self.engine.engine.config.speculation.method

    def submit(self, messages: list[dict[str, str]], sampling: SamplingConfig | None,
               session_id: str, method: str | None) -> ChatHandle:
        return self.engine.submit(encode_chat(self.tokenizer, messages), sampling, session_id,
                                  method)

    def drop_session(self, session_id: str) -> None:
        self.engine.engine.drop_session(session_id)
