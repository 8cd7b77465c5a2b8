"""A turn cue from the language model: does the caller's message end where they paused?

Whisper punctuates what it hears, so a caller who stops to think after "What is the capital"
reads as the finished question "What is the capital?", and a word list cannot tell. LiveKit's
turn detector asks a small language model instead: the probability that the user's message ends
at this point. We ask the in-process target the same question, on the words without case or
punctuation (what was said, not how Whisper wrote it): log p(the message or its sentence ends
here), the target's probability that the next token is the template's end of turn or a closing
mark (".", "?", "!"). The end-of-turn token alone reads a question without its "?" as going on
("can you help me" -26 against "what is the capital" -24); with the marks, most finished
messages score -0.1 to -6 and most fragments -6 to -14 on the embedded SmolLM2-135M-Instruct
(-8.4 for "what is the capital"; `voiceagent bench cue` scores a labelled set on any target).
Below `turn.unfinished_logprob` the words sound unfinished and the turn waits its hold.

One forward of the message alone (no system prompt or history), on a cache of the engine's own
that keeps the template's KV: ~12-16 ms for a sentence on 2 cores. It is asked for at the pause
transcript, during the hangover, so that at the VAD stop it is ready; when it is not, the reply
starts on the words as they stand while the score decides. Each score is a forward of its own
on the worker the replies share, so the turn strategy asks for one on words that end finished
only while no reply is in flight (`idle`).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict

from loguru import logger

from llm_engine.serving import EngineWorker

_SENTINEL = "\u2063utterance\u2063"  # an invisible separator no caller's words contain
_KEEP = 16  # recent scores kept (a call's pause and final transcripts repeat each other)
_CLOSING = ".?!"
_WARNED: set[str] = set()  # tokenizers whose closing marks were found wanting


def normalise(text: str) -> str:
    """The words as said: lower case, punctuation dropped (apostrophes kept)."""
    return " ".join(re.sub(r"[^\w\s']", " ", text.lower()).split())


class UtteranceEnd:
    """`unfinished(text)`: whether the target thinks the message goes on after `text`."""

    def __init__(self, worker: EngineWorker, tokenizer, threshold: float):
        self.worker = worker
        self.tokenizer = tokenizer
        self.threshold = threshold
        self._prefix, self._ends = _message_frame(tokenizer)
        self._scores: OrderedDict[str, asyncio.Task] = OrderedDict()

    def warm(self) -> None:
        """Score once ahead of the first turn: the engine keeps the template's KV, so later
        scores run only their own words."""
        if not self._scores:
            self.prefetch("hello")

    def prefetch(self, text: str) -> None:
        """Start scoring `text` now, so that `unfinished(text)` later finds it done."""
        words = normalise(text)
        if not words or words in self._scores:
            return
        task = asyncio.ensure_future(self._score(words))
        task.add_done_callback(_seen)  # a prefetch nobody awaits may fail unheard
        self._scores[words] = task
        while len(self._scores) > _KEEP:
            self._scores.popitem(last=False)[1].cancel()

    @property
    def idle(self) -> bool:
        """Whether the engine has no reply in flight (a score now delays none; a one-token
        prefill of the caller's words so far is not a reply)."""
        return self.worker.replies_in_flight == 0

    def asked(self, text: str) -> bool:
        """Whether `text`'s words are being scored or were (recently)."""
        return normalise(text) in self._scores

    def ready(self, text: str) -> bool:
        """Whether `text`'s score is in (so `unfinished` answers without waiting)."""
        task = self._scores.get(normalise(text))
        return task is not None and task.done()

    async def score(self, text: str) -> float:
        """log p(the message or its sentence ends after `text`'s words); each words once.
        Raises what scoring raised (the words are then scored again when next asked)."""
        words = normalise(text)
        if not words:
            raise ValueError("no words to score")
        self.prefetch(words)
        task = self._scores[words]
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():  # the asker was cancelled, not the score
                raise
            self._scores.pop(words, None)  # evicted or closed: a failed score, not a cancel
            raise RuntimeError("the score was cancelled") from None
        except Exception:
            self._scores.pop(words, None)
            raise

    async def unfinished(self, text: str) -> bool:
        if not normalise(text):
            return False
        try:
            logprob = await self.score(text)
        except Exception as exc:  # a cue, not a stage: without it the words alone decide
            logger.warning(f"end-of-utterance score failed: {exc}")
            return False
        logger.debug(f"end of utterance: log p = {logprob:.1f} after [{normalise(text)}]")
        return logprob < self.threshold

    async def _score(self, words: str) -> float:
        ids = self.tokenizer.encode(self._prefix + words, add_special_tokens=False)
        t0 = time.perf_counter()
        logprob = await self.worker.next_logprob(ids, self._ends)
        ms = (time.perf_counter() - t0) * 1000
        logger.debug(f"end of utterance: [{words}] scored in {ms:.0f} ms")
        return logprob

    def close(self) -> None:
        for task in self._scores.values():
            task.cancel()
        self._scores.clear()


def _seen(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def _message_frame(tokenizer) -> tuple[str, list[int]]:
    """What the chat template writes before a user message, and the tokens that end one: the
    first token the template writes after it (its end-of-turn marker: <|im_end|>, <|eot_id|>,
    [/INST], ...) and the closing marks as they follow a word."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=False)
    if rendered.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not write the user's message as given")
    prefix, suffix = rendered.split(_SENTINEL)
    after = tokenizer.encode(suffix, add_special_tokens=False)
    if not after:
        raise ValueError("the chat template writes nothing after a user's message")
    marks = _marks(tokenizer)
    if len(marks) < len(_CLOSING) and tokenizer.name_or_path not in _WARNED:
        _WARNED.add(tokenizer.name_or_path)  # once a process, not once a call
        logger.warning(f"the tokenizer writes only {len(marks)} of the closing marks "
                       f"{_CLOSING!r} as tokens of their own: questions and sentences that "
                       "end without them read as going on (see `voiceagent bench cue`)")
    return prefix, [after[0], *marks]


def _marks(tokenizer) -> list[int]:
    """The tokens of ".", "?" and "!" right after a word, where the tokenizer writes each as one
    token of its own there (a mark merged into the word's token is left out)."""
    word = tokenizer.encode("so", add_special_tokens=False)
    marks = []
    for mark in _CLOSING:
        ids = tokenizer.encode("so" + mark, add_special_tokens=False)
        if len(ids) == len(word) + 1 and ids[:-1] == word:
            marks.append(ids[-1])
    return marks
