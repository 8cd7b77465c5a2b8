"""A caller who goes on with their sentence just after the bot began to answer it.

"What is the capital" (a pause a turn end could not tell from a finished question) "of Spain?":
the turn ended at the pause, the reply began, and the caller's next words interrupt it. Heard
as a barge-in, that is two turns: the model sees "What is the capital?", a cut-off "The", and
"of Spain?", and answers the fragment. A person would take the words as one sentence and drop
the answer they had begun. So when the caller speaks again within `turn.continue_within_s` of
the reply's commit (nothing heard yet) or of its first audio, the interrupted reply is withdrawn
from what the model sees and the caller's message before it and the one after are joined: one
message, one answer. Later speech is a barge-in as before. A reply that ran a tool is never
withdrawn this way: its side effects happened.

The context keeps its messages as pipecat wrote them (the cut-off reply included); `joined`
rewrites them for each prompt from the indices recorded here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from pipecat.processors.aggregators.llm_context import LLMSpecificMessage, standard_message_text

_ENDINGS = ".?!…。"  # Whisper's sentence end on the first part is not the caller's


class Continuations:
    """When the call's latest reply was committed and first heard, and which user messages the
    caller went on with (indices in the call's context)."""

    def __init__(self, within_s: float, clock: Callable[[], float] = time.monotonic):
        self.within_s = within_s
        self.joins: set[int] = set()
        self._clock = clock
        self._committed_at: float | None = None
        self._heard_at: float | None = None
        self._ran_tools = False

    def committed(self) -> None:
        """A reply to the caller's latest turn was committed."""
        self._committed_at, self._heard_at, self._ran_tools = self._clock(), None, False

    def ran_tools(self) -> None:
        """The committed reply's tool calls ran."""
        self._ran_tools = True

    def heard(self) -> None:
        """The bot's audio began."""
        if self._committed_at is not None and self._heard_at is None:
            self._heard_at = self._clock()

    def finished(self) -> None:
        """The bot's audio stopped: the reply was heard, speech from now on is a new turn."""
        self._committed_at = self._heard_at = None

    def interrupted(self, messages: Sequence[Any]) -> bool:
        """The caller interrupted the reply: whether they go on with the sentence it answered.
        If so, the last user message in `messages` (the call's context) joins the next one."""
        since = self._heard_at if self._heard_at is not None else self._committed_at
        self._committed_at = self._heard_at = None
        if self.within_s <= 0 or since is None or self._ran_tools:
            return False
        if self._clock() - since > self.within_s:
            return False
        last = next((i for i in range(len(messages) - 1, -1, -1)
                     if _role(messages[i]) == "user"), None)
        if last is None:
            return False
        self.joins.add(last)
        return True


def joined(messages: Sequence[Any], joins: set[int]) -> list[Any]:
    """`messages` with each user message in `joins` joined to the next user message, the plain
    assistant messages between them (the withdrawn reply) left out. A pair with anything else
    between (a tool call, its result) stays as it is."""
    out: list[Any] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        text = None
        while i in joins and _role(message) == "user":
            k = i + 1
            while k < len(messages) and _plain_assistant(messages[k]):
                k += 1
            if k >= len(messages) or _role(messages[k]) != "user":
                break
            first = standard_message_text(message) if text is None else text
            text = f"{first.rstrip().rstrip(_ENDINGS)} {standard_message_text(messages[k]).strip()}"
            i, message = k, messages[k]
        out.append(message if text is None else {"role": "user", "content": text})
        i += 1
    return out


def _role(message: Any) -> str | None:
    return None if isinstance(message, LLMSpecificMessage) else message.get("role")


def _plain_assistant(message: Any) -> bool:
    return _role(message) == "assistant" and not message.get("tool_calls")
