"""Cut streamed LLM text into clauses, so speech synthesis can start before the sentence ends.

A clause ends at . ! ? ; : , an ellipsis, a spaced dash or a newline. Punctuation only counts once
the whitespace after it has arrived: that is what tells "3.5" and "1,000" (no space) from the end
of a clause, at the cost of waiting for the next token. Closing quotes and brackets stay with the
clause they close. A clause shorter than `min_chars` is not sent alone ("Hi," "1."): it is joined
to the next one, because a fragment that short sounds choppy and saves almost no time.

The first phrase of a reply may end earlier, at a phrase boundary: with `first_phrase_words` set,
once that many words have arrived, a word that opens a new phrase ("and", "with", "because",
"in"...) ends the first phrase before it. Speech starts after a few words instead of a whole
clause, and the break falls where a speaker may pause, so the prosody stays natural.
"""

from __future__ import annotations

ENDINGS = set(".!?;:,…")
DASHES = set("-–—")
CLOSERS = set("\"')]}”’»")
# Words that end in a period without ending a sentence. Single letters (initials) and dotted
# forms (e.g., U.S.) are caught by rule; "etc." is left out because it usually ends the clause.
ABBREVIATIONS = {
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "vs", "inc", "ltd", "co", "corp",
    "no", "approx", "dept", "est", "fig", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep",
    "sept", "oct", "nov", "dec", "ave", "blvd", "rd", "gen", "gov", "sen", "rep", "capt", "lt",
}
# Words before which a first phrase may end: conjunctions, relative words and prepositions.
PHRASE_OPENERS = {
    "and", "but", "or", "so", "because", "since", "although", "though", "while", "which", "who",
    "where", "when", "that", "if", "unless", "until", "with", "without", "for", "from", "in",
    "on", "at", "by", "about", "after", "before", "during", "into", "through", "to", "than",
}


class ClauseSplitter:
    """Feed text deltas with `push`; get complete clauses back; `flush` returns the rest."""

    def __init__(self, min_chars: int = 6, first_phrase_words: int = 0):
        self.min_chars = min_chars
        self.first_phrase_words = first_phrase_words  # 0: the first phrase is a whole clause
        self._buf = ""
        self._scan = 0  # buffer offset up to which no boundary needs checking again
        self._first = True  # nothing returned yet since the start (or reset)

    @property
    def pending(self) -> str:
        """Text received but not yet returned as a clause."""
        return self._buf

    def push(self, delta: str) -> list[str]:
        """Add a delta; return the clauses it completed, in order (often none)."""
        self._buf += delta
        clauses = []
        while (end := self._next_boundary()) is not None:
            clause = self._buf[:end].strip()
            self._buf = self._buf[end:].lstrip()
            self._scan = 0
            if clause:
                clauses.append(clause)
        if not clauses and self._first and (end := self._first_phrase_end()) is not None:
            clauses.append(self._buf[:end].strip())
            self._buf = self._buf[end:].lstrip()
            self._scan = 0
        self._first = self._first and not clauses
        return clauses

    def flush(self) -> str | None:
        """End of the stream: return whatever is left (even if short), and start afresh."""
        rest = self._buf.strip()
        self.reset()
        return rest or None

    def reset(self) -> None:
        self._buf = ""
        self._scan = 0
        self._first = True

    def _first_phrase_end(self) -> int | None:
        """Offset of a phrase opener after at least `first_phrase_words` words, or None."""
        if not self.first_phrase_words:
            return None
        words = self._buf.split(" ")
        if len(words) <= self.first_phrase_words + 1:
            return None  # the opener must be followed by a space: a whole word
        offset = 0
        for n, word in enumerate(words[:-1]):
            if n >= self.first_phrase_words and word.lower() in PHRASE_OPENERS:
                return offset
            offset += len(word) + 1
        return None

    def _next_boundary(self) -> int | None:
        """Offset just after the first accepted clause end in the buffer, or None."""
        buf = self._buf
        i = self._scan
        while i < len(buf):
            c = buf[i]
            if c == "\n":
                end, confirmed = i + 1, True
            elif c in ENDINGS or c in DASHES:
                end = i + 1
                while end < len(buf) and (buf[end] in ENDINGS or buf[end] in CLOSERS):
                    end += 1  # "?!", "...", '."' stay together
                if end == len(buf):
                    self._scan = i  # wait for the character after the punctuation
                    return None
                confirmed = buf[end].isspace() and self._ends_clause(buf, i, c)
            else:
                i += 1
                continue
            if confirmed and len(buf[:end].strip()) >= self.min_chars:
                return end
            i = end
        self._scan = i
        return None

    @staticmethod
    def _ends_clause(buf: str, i: int, c: str) -> bool:
        """Whether punctuation `c` at `i`, followed by whitespace, ends a clause."""
        if c in DASHES:  # "well-known" is a word; only a dash with space around it splits
            return i > 0 and buf[i - 1].isspace()
        if c != ".":
            return True
        word = buf[:i].split()[-1] if buf[:i].split() else ""
        word = word.lstrip("\"'([{“‘«")
        if word.lower() in ABBREVIATIONS:
            return False
        if len(word) == 1 and word.isalpha():  # an initial: "J. K. Rowling"
            return False
        return "." not in word  # "e.g." "U.S." "a.m."


def split_clauses(text: str, min_chars: int = 6, first_phrase_words: int = 0) -> list[str]:
    """Split a whole text into clauses, by the same rules as the streaming splitter."""
    splitter = ClauseSplitter(min_chars, first_phrase_words)
    clauses = splitter.push(text)
    rest = splitter.flush()
    return clauses + [rest] if rest else clauses
