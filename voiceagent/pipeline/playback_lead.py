"""How far a reply's synthesised audio runs ahead of the caller's playback.

Piper synthesises faster than real time, so left alone a reply's later phrases are all
synthesised within a few hundred milliseconds of its first audio, and a long reply then holds
the cores just when another caller's reply heads for its first audio. The caller needs a
phrase's audio only as its playback reaches it: `PlaybackLead` says how long the next phrase's
synthesis may wait and still leave `lead_s` of audio ahead.

Playback is taken to start at the reply's first chunk and to run in real time. It starts no
earlier (a prepared reply's audio is held until the turn ends) and stalls rather than runs ahead,
so the audio ahead is never more than estimated: waiting never makes the caller hear a gap that
synthesising at once would have avoided, given `lead_s` longer than a phrase's synthesis.
"""

from __future__ import annotations


class PlaybackLead:
    def __init__(self, lead_s: float, max_wait_s: float):
        """lead_s: the audio kept ahead of playback, in seconds; 0: no waiting. max_wait_s: the
        longest one wait (pipecat's TTS ends a reply's audio context after a quiet spell)."""
        self.lead_s, self.max_wait_s = lead_s, max_wait_s
        self._audio_s = 0.0
        self._first_at: float | None = None  # monotonic, when the reply's first chunk came

    def start(self) -> None:
        """A new reply (or spoken text): nothing of it synthesised yet."""
        self._audio_s, self._first_at = 0.0, None

    def synthesised(self, seconds: float, now: float) -> None:
        """A chunk of `seconds` of audio is out, at monotonic time `now`."""
        if self._first_at is None:
            self._first_at = now
        self._audio_s += seconds

    def wait_s(self, now: float) -> float:
        """How long the next chunk's synthesis may wait at monotonic time `now`."""
        if self.lead_s <= 0 or self._first_at is None:
            return 0.0
        ahead = self._audio_s - (now - self._first_at)
        return min(self.max_wait_s, max(0.0, ahead - self.lead_s))
