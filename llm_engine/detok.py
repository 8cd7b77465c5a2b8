"""Incremental detokenisation and stop strings for streaming.

`IncrementalDetokenizer` follows the prefix_offset/read_offset scheme of vLLM's
`detokenize_incrementally` and TGI's `decode_token`: each push decodes only a short window of
recent tokens, twice (the already-emitted prefix of the window, and the whole window), and emits
the difference. Decoding a window that starts one emitted token back keeps word-piece spacing
right: SentencePiece ('▁') and WordPiece decoders strip or join at the start of a decoded string,
and that effect then falls on the subtracted prefix, not on the new text.

Where we differ from vLLM: vLLM holds back the whole delta while the window ends in U+FFFD (an
incomplete UTF-8 character). We emit the delta up to the trailing run of U+FFFD and hold back only
that run, so "Hello " is not delayed by a half-received emoji. Text before that run is final:
appending bytes can only change an incomplete tail, which both lossy UTF-8 decoders (Rust's
`from_utf8_lossy`, Python's errors="replace") render at the end of the string. Byte-fallback
decoders (Llama 2, Mistral) turn a whole run of byte tokens into U+FFFD while any of it is
incomplete, which the same rule absorbs; only for invalid byte runs (a broken model) can their
stream then differ from a final decode.

Output never applies `clean_up_tokenization_spaces`: that rewrite (" ." -> ".") looks ahead at
later text and cannot be streamed. vLLM does the same.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens kept as window prefix, as in vLLM
MAX_HELD_TOKENS = 64  # tokens past the last clean boundary before the window is resynced
MAX_INVISIBLE_TOKENS = 256  # window kept across text-less tokens (specials) at most this long


def _trailing_replacements(text: str) -> int:
    return len(text) - len(text.rstrip(REPLACEMENT))


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    Invariant: the concatenation of all `push` results and `flush()` equals
    `tokenizer.decode(generated_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
    (without a prompt), for any split of the ids into pushes, when the bytes are valid UTF-8.
    """

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
    ):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # The window is _ids[_start:]; _ids[_start:_read] was emitted (the prefix).
        prompt = [] if prompt_ids is None else [int(t) for t in prompt_ids]
        self._ids = prompt[-PROMPT_CONTEXT_TOKENS:]
        self._start = 0
        self._read = len(self._ids)
        self._prefix_chars = len(self._decode(self._ids))
        self._extra = 0  # chars emitted beyond the prefix while the window ends in U+FFFD

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(
            ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False
        )

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that became stable (possibly "")."""
        if len(token_ids) == 0:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit everything held back (an incomplete character becomes U+FFFD, as in decode)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        text = self._decode(self._ids[self._start :])
        emitted = self._prefix_chars + self._extra
        held = _trailing_replacements(text)
        if not held or final:
            self._slide(len(self._ids), len(text), len(text))
            return text[emitted:]
        # An incomplete character may still complete: emit only what precedes it. With
        # byte-fallback decoders the held run can swallow already-emitted text, so the
        # stable end can fall before `emitted`; then nothing new is stable yet.
        delta = text[emitted : len(text) - held]
        self._extra += len(delta)
        if len(self._ids) - self._read > MAX_HELD_TOKENS:
            delta += self._resync(text, emitted + len(delta))
        return delta

    def _resync(self, text: str, emitted: int) -> str:
        """Bound the window when many pushes in a row ended mid-character.

        Slide to the latest clean token boundary (one where the decoded head has no trailing
        U+FFFD). Valid text has one within a few tokens; if there is none in the whole held
        span the bytes are invalid and cannot complete: release them as U+FFFD, as decode
        would.
        """
        for r in range(len(self._ids) - 1, self._read, -1):
            head = self._decode(self._ids[self._start : r])
            if head and not _trailing_replacements(head):
                # A byte-fallback decoder may have hidden part of `head` in the held run;
                # emit it now so that everything before the new window start is out.
                delta = head[emitted:]
                self._slide(r, len(head), max(emitted, len(head)))
                return delta
        self._slide(len(self._ids), len(text), len(text))
        return text[emitted:]

    def _slide(self, read: int, head_chars: int, emitted: int) -> None:
        """Move the read point to the clean boundary `read` (decode(window[:read]) has
        `head_chars` chars, `emitted` of the window's chars are out) and start the window
        at the tokens emitted since the last boundary, as vLLM does."""
        old_read, self._read = self._read, read
        shown = self._decode(self._ids[old_read:read])
        if shown or read - self._start > MAX_INVISIBLE_TOKENS:
            self._start, self._prefix_chars = old_read, len(shown)
        else:
            # Those tokens show no text (skipped specials, a lone '▁'): a window starting
            # there would lose the leading space of the next word, so keep the old start.
            self._prefix_chars = head_chars
        self._extra = emitted - head_chars
        if self._start > 4 * MAX_HELD_TOKENS:  # drop consumed ids now and then, amortised O(1)
            del self._ids[: self._start]
            self._read -= self._start
            self._start = 0


class StopMatcher:
    """Cuts a text stream exactly before the first occurrence of any stop string.

    `feed(delta)` returns (text_to_emit, stopped). A suffix of the stream that could be the
    start of a stop string is held back until the next delta decides it; `flush()` releases it
    when the stream ends without a stop. The emitted text never contains any part of a stop.
    """

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(stops)
        self._held = ""
        self.stopped = False
        self.stop: str | None = None  # the stop string that matched

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self._held + delta
        hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            cut, self.stop = min(hits)
            self._held = ""
            self.stopped = True
            return text[:cut], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
