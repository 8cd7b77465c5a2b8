"""Figures as the reports, benches and dashboard compute and write them: one percentile (numpy's
linear interpolation) and one way to print a measurement that may be missing."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

MISSING = "–"  # a figure with no measurement behind it, never shown as 0


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) of the values; None when there are none."""
    xs = [float(v) for v in values]
    return float(np.percentile(xs, q)) if xs else None


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return MISSING if value is None else f"{value:.{digits}f}{suffix}"


def fmt_share(share: float | None, digits: int = 0) -> str:
    """A share in [0, 1] as a percentage."""
    return MISSING if share is None else f"{100 * share:.{digits}f}%"
