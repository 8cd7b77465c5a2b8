"""Prompt prefixes that many sessions start from (a voice agent's system prompt and tools): their
KV computed once (`SpeculativeEngine.keep_prefix`, at load) and copied into a new session's
cache, so that a call's first turn prefills only its own words.

A session's later turns already reuse its own cache (`SpeculativeEngine._take_session`); this
is for the first turn of every call, which otherwise prefills the whole system prompt: ~400
tokens, 1.9-2.1 s on an AVX2-only CPU, during which every other call's decoding waits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from llm_engine import kv

MIN_TOKENS = 32  # a shorter common prefix is not worth a copy


class SharedPrefixes:
    def __init__(self, runner, capacity: int = 4, min_tokens: int = MIN_TOKENS):
        """runner: the target's (`TargetRunner.copy_prefix`); capacity: prefixes kept, the most
        recently used."""
        self.runner = runner
        self.capacity = capacity
        self.min_tokens = min_tokens
        self._kept: OrderedDict[tuple[int, ...], object] = OrderedDict()  # tokens -> compact KV
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def start(self, prompt_ids: list[int]):
        """A new cache holding the longest kept prefix of `prompt_ids` (at least `min_tokens`,
        and short of its last token, whose logits the request needs), and that prefix's length;
        (None, 0) when none is kept."""
        with self._lock:
            best, length = None, 0
            for tokens in self._kept:
                n = min(kv.common_prefix_len(tokens, prompt_ids), len(prompt_ids) - 1)
                if n > length:
                    best, length = tokens, n
            if best is None or length < self.min_tokens:
                return None, 0
            self._kept.move_to_end(best)
            source = self._kept[best]
        return self.runner.copy_prefix(source, length), length

    def keep(self, prompt_ids: list[int], cache) -> None:
        """Keep a copy of the first len(prompt_ids) positions of `cache` (just prefilled)."""
        if len(prompt_ids) < self.min_tokens:
            return
        copy = self.runner.copy_prefix(cache, len(prompt_ids), compact=True)
        with self._lock:
            self._kept[tuple(prompt_ids)] = copy
            self._kept.move_to_end(tuple(prompt_ids))
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
