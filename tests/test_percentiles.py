"""The one percentile definition (pdserve/percentiles.py) is numpy's linear one, float for float."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.percentiles import percentile, percentiles, summary


def test_same_float_as_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 10, 11, 100, 1001):
        values = list(rng.lognormal(size=n)) + list(rng.integers(0, 5, size=n).astype(float))
        for p in (0, 1, 10, 25, 50, 66.6, 90, 95, 99, 99.9, 100):
            assert percentile(values, p) == float(np.percentile(values, p)), (n, p)


def test_small_cases() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    assert percentile([1.0], 90) == 1.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # unsorted input is sorted
    assert percentile([float(i) for i in range(11)], 90) == pytest.approx(9.0)
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], 101)


def test_keys_and_summary() -> None:
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert list(percentiles([1.0], (50, 99.9))) == ["p50", "p99.9"]
    got = summary([1.0, 2.0, 3.0, 4.0])
    assert list(got) == ["mean", "p50", "p90", "p99"]
    assert got["mean"] == 2.5 and got["p50"] == 2.5
    assert summary([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
