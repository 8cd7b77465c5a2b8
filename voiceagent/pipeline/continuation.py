"""A caller who goes on with their sentence just after the bot began to answer it.

"What is the capital" (a pause a turn end could not tell from a finished question) "of Spain?":
the turn ended at the pause, the reply began, and the caller's next words interrupt it. Heard
as a barge-in, that is two turns: the model sees "What is the capital?", a cut-off "The", and
"of Spain?", and answers the fragment. A person would take the words as one sentence and drop
the answer they had begun. So when the caller speaks again before any of the reply's audio was
heard (it may be held while their voice rises: onset_hold.py), or within
`turn.continue_within_s` of its first audio and before any of its clauses was played to the end,
the interrupted reply is withdrawn from what the model sees and the caller's
message before it and the one after are joined: one message, one answer. Later speech is a
barge-in as before, and so is speech after a clause the caller heard ("No." / "Why not?"). A
reply that ran a tool is never withdrawn this way: its side effects happened.

The context keeps its messages as pipecat wrote them (the cut-off reply included); `joined`
rewrites them for each prompt from the indices recorded here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
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

    def interrupted(self, messages: Sequence[Any]) -> None:
        """The caller interrupted the reply: if they may be going on with the sentence it
        answered, the last user message in `messages` (the call's context) joins the next one,
        as long as nothing of the reply is written between (`joined`)."""
        committed, heard = self._committed_at, self._heard_at
        self._committed_at = self._heard_at = None
        if self.within_s <= 0 or committed is None or self._ran_tools:
            return
        # Nothing of the reply heard yet: the caller cannot be answering it, however long it took.
        if heard is None or self._clock() - heard <= self.within_s:
            if (last := _last_user(messages)) is not None:
                self.joins.add(last)


def joined(messages: Sequence[Any], joins: Collection[int]) -> list[Any]:
    """`messages` with each user message in `joins` joined to the next user message and the
    withdrawn reply between them left out. Only a reply of which nothing was heard to the end
    is withdrawn (pipecat writes an interrupted reply's played clauses into the context): once
    the caller heard "No.", "Why not?" is a new turn, and a tool call or its result between the
    two keeps them apart too."""
    out: list[Any] = []
    i = 0
    while i < len(messages):
        message, text = messages[i], None
        while i in joins and (k := _next_user(messages, i)) is not None:
            first = standard_message_text(message) if text is None else text
            then = standard_message_text(messages[k]).strip()
            text = f"{first.rstrip().rstrip(_ENDINGS)} {then}"
            i, message = k, messages[k]
        out.append(message if text is None else {"role": "user", "content": text})
        i += 1
    return out


def continues_last(messages: Sequence[Any], joins: Collection[int]) -> bool:
    """Whether the last user message in `messages` goes on with an earlier one (`joined`)."""
    last = _last_user(messages)
    return last is not None and any(_next_user(messages, i) == last for i in joins)


def _next_user(messages: Sequence[Any], i: int) -> int | None:
    """The user message that user message `i` joins: the next one, with only withdrawn replies
    between; None if there is none such."""
    if i >= len(messages) or _role(messages[i]) != "user":
        return None
    k = i + 1
    while k < len(messages) and _withdrawn(messages[k]):
        k += 1
    return k if k < len(messages) and _role(messages[k]) == "user" else None


def _last_user(messages: Sequence[Any]) -> int | None:
    return next((i for i in range(len(messages) - 1, -1, -1) if _role(messages[i]) == "user"),
                None)


def _role(message: Any) -> str | None:
    return None if isinstance(message, LLMSpecificMessage) else message.get("role")


def _withdrawn(message: Any) -> bool:
    """An assistant message with nothing the caller heard to the end, and no tool call."""
    return (_role(message) == "assistant" and not message.get("tool_calls")
            and not (standard_message_text(message) or "").strip())
