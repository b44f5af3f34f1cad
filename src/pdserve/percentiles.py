"""The one percentile definition of pdserve: what every report, the dashboard, the simulator and
`pdserve chaos` call a p50, p90 or p99.

Definition: numpy's default (`np.percentile(values, p)`, method "linear", Hyndman & Fan type 7):
sort the n values, take the position (n - 1) * p / 100 and interpolate linearly between the two
values around it. So p0 is the minimum, p100 the maximum, p50 the median, and a percentile of
one value is that value. Computed here in plain Python, arithmetic for arithmetic as numpy does
it (the same float, tests/test_percentiles.py checks), so the router's dashboard needs no numpy.
Of no values, `percentile` raises ValueError (as `statistics.median` does) and the summaries
give None: "no sample" is not a zero latency.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

DEFAULT = (50, 90, 99)  # the percentiles every latency summary reports


def percentile(values: Iterable[float], p: float) -> float:
    """The `p`-th percentile (0 <= p <= 100) of `values`, numpy's linear definition."""
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("percentile of no values")
    return _sorted_percentile(ordered, _checked((p,))[0])


def percentiles(values: Iterable[float], ps: Sequence[float] = DEFAULT) -> dict[str, float | None]:
    """{"p50": ..., "p90": ..., "p99": ...} (keys "p" + each of `ps`), None each when empty."""
    ordered = sorted(float(v) for v in values)
    return {f"p{p:g}": _sorted_percentile(ordered, p) if ordered else None for p in _checked(ps)}


def summary(values: Iterable[float], ps: Sequence[float] = DEFAULT) -> dict[str, float | None]:
    """{"mean": ..., "p50": ..., "p90": ..., "p99": ...}: what a latency table shows."""
    vals = [float(v) for v in values]
    return {"mean": math.fsum(vals) / len(vals) if vals else None, **percentiles(vals, ps)}


def _checked(ps: Sequence[float]) -> Sequence[float]:
    bad = [p for p in ps if not 0 <= p <= 100]
    if bad:
        raise ValueError(f"percentiles {bad} are outside [0, 100]")
    return ps


def _sorted_percentile(ordered: list[float], p: float) -> float:
    # numpy: position (n - 1) * q with q = p / 100, its floor and the next index (both the last
    # one at the top), and `_lerp`, which interpolates from the nearer end (exact at t = 0, 1)
    pos = (len(ordered) - 1) * (p / 100)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    a, b, t = ordered[lo], ordered[hi], pos - lo
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t
