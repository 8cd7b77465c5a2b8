"""The A/B baseline from live traffic: which calls `serve` runs with speculation off.

The dashboard's ITL speed-up compares each method with the turns decoded with speculation off.
Without such turns it stays empty, so the server holds out `server.ab_off_share` of its calls
with speculation off. The held-out calls are spread evenly rather than drawn at random: call k
(from 0) is held out when floor((k + 1) * share) > floor(k * share), so any run of n calls holds
out share * n of them, to within one, and the baseline fills at the rate asked for.
"""

from __future__ import annotations

import math


class OffHoldout:
    def __init__(self, share: float):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"a share of calls is in [0, 1], not {share}")
        self.share = share
        self._calls = 0

    def next_is_off(self) -> bool:
        """Whether the next call is held out with speculation off."""
        k, self._calls = self._calls, self._calls + 1
        # The epsilon keeps k * share on the right side of an integer that float rounding misses
        # (0.1 * 30 = 3.0000000000000004, 0.7 * 10 = 7.000000000000001).
        return math.floor((k + 1) * self.share + 1e-9) > math.floor(k * self.share + 1e-9)
