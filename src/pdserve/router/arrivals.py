"""The planner's picture of the request rate (`SloPlanner.arrivals`): first attempts only, a
retry being no new request.

Two views of the same arrivals:
* `rate()`: over the last ARRIVAL_WINDOW arrivals, whatever time they span: what the next few
  seconds bring (a burst reads as its own rate);
* `rate_over(now, seconds)`: the mean over the last `seconds` before `now`, the time before the
  first arrival counted as idle: what arrives during a window as long as that. The requests
  that join a decode worker during a new request's answer (`SloPlanner.joining`) are priced at
  the rate over the answer's own length: at a burst's rate, four prompts in 1.3 s were
  extrapolated over a 15-s answer, the planner predicted TPOTs over 100 ms for requests that
  decoded at 40-68 ms and refused them (the seeds' case at 1.05-1.2 req/s).

`future_stall`: what a local prefill costs the requests that reach its decode worker meanwhile.
"""

from __future__ import annotations

from collections import deque

ARRIVAL_WINDOW = 16  # arrivals `rate` is measured over
HORIZON_S = 300.0  # the longest window `rate_over` answers for (older arrivals are dropped)


class Arrivals:
    def __init__(self) -> None:
        self._last: deque[float] = deque(maxlen=ARRIVAL_WINDOW)
        self._recent: deque[float] = deque()

    def add(self, now: float) -> None:
        self._last.append(now)
        self._recent.append(now)
        while self._recent and self._recent[0] < now - HORIZON_S:
            self._recent.popleft()

    def rate(self) -> float:
        """Requests per second over the last ARRIVAL_WINDOW arrivals (0 until two came apart
        in time)."""
        if len(self._last) < 2 or self._last[-1] <= self._last[0]:
            return 0.0
        return (len(self._last) - 1) / (self._last[-1] - self._last[0])

    def rate_over(self, now: float, seconds: float) -> float:
        """Arrivals in the last `seconds` (at most HORIZON_S) before `now`, per second; one
        at `now` itself (the request being decided) is not counted."""
        seconds = min(seconds, HORIZON_S)
        if seconds <= 0:
            return 0.0
        return sum(1 for t in self._recent if now - seconds <= t < now) / seconds


def future_stall(prefill: float, rate: float) -> float:
    """Expected delay a local prefill of `prefill` seconds adds to requests that reach the
    decode worker while it runs: they arrive at the worker's rate, each waits on average
    half of it. The requests decoding there already are charged in `SloPlanner._running`. Why: with
    only those counted, an idle P and an idle D tie on a long prompt, and the local route
    won by the hand-off's few ms. Every request then prefilled on D (KB-QA on 2 cores,
    2000-token prompts: P idle, D doing both phases, attainment 75% against 88-100% with
    every prefill on P). A prompt queued on P is not charged the same way: a later prompt
    can still be routed around P's queue, while the decodes on D cannot leave it."""
    return rate * prefill * prefill / 2
