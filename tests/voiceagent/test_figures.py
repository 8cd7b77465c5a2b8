"""voiceagent.figures: the one percentile and the way a missing figure is written."""

import pytest

from voiceagent.figures import MISSING, fmt, fmt_share, percentile


def test_percentile_interpolates_linearly_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 100) == 4.0
    assert percentile(range(1, 102), 95) == pytest.approx(96.0)
    assert percentile([], 50) is None


def test_a_missing_figure_is_a_dash_never_a_zero():
    assert fmt(None) == fmt_share(None) == MISSING
    assert fmt(0.0) == "0.0" and fmt(12.345, 2, " ms") == "12.35 ms"
    assert fmt_share(0.256) == "26%"
