"""The load generator's closed loop on simulated time: `pdserve bench serve --concurrency N
--think-time S --think-dist D`, request for request (bench/load/serve_bench.py `_Ready` and
`run_benchmark`).

  * at most `concurrency` requests in flight; a free slot takes the head of a FIFO of ready
    requests at once;
  * the ready FIFO starts with every conversation's first turn, in workload order (a request
    outside a conversation is one of its own), so all first turns go before any later one;
  * when a request ends (its last token, or rejected: the load generator releases the next turn
    after a 429 too, its prompt carrying no answer), its conversation's next turn joins the back
    of the FIFO after a think time: `workloads.spec.think_times`, the generator's seeded draws,
    one per released turn in the order turns end.

A request's arrival is when it is sent (its TTFT counts from there, as the client's does); the
arrival times the workload drew are ignored.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.sim.records import SimRequest
from pdserve.workloads.spec import check_think, think_times


@dataclass(frozen=True)
class ClosedLoop:
    """The closed loop's settings, as `bench serve`'s flags name them."""

    concurrency: int
    think_time: float = 0.0  # s, the mean with the exponential distribution
    think_dist: str = "exponential"
    seed: int = 0  # the think times' (`bench serve --seed`)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        check_think(self.think_time, self.think_dist)

    def describe(self) -> str:
        think = f"{self.think_time:g} s ({self.think_dist})" if self.think_time else "none"
        return f"closed loop: {self.concurrency} requests in flight, think time {think}"


class LoopDriver:
    """Sends the requests of one run as the closed loop would, through `send` (the router's
    arrival) at times scheduled with `at`; told of each request's end by `ended`."""

    def __init__(
        self,
        load: ClosedLoop,
        requests: Sequence[SimRequest],
        at: Callable[[float, Callable[[], None]], None],
        now: Callable[[], float],
        send: Callable[[SimRequest], None],
    ) -> None:
        self.at, self.now, self.send = at, now, send
        self.free = load.concurrency
        self.think = think_times(load.think_time, load.think_dist, load.seed)
        self._turns: dict[int, deque[SimRequest]] = {}  # conversation -> turns not yet released
        self._conv: dict[str, int] = {}
        for i, req in enumerate(requests):
            conv = req.conversation if req.conversation >= 0 else -1 - i
            self._conv[req.rid] = conv
            self._turns.setdefault(conv, deque()).append(req)
        self.ready: deque[SimRequest] = deque(q.popleft() for q in self._turns.values())

    def start(self) -> None:
        self.at(0.0, self._send)

    def ended(self, rid: str) -> None:
        """A request finished or was rejected: its slot frees, its next turn thinks."""
        self.free += 1
        turns = self._turns[self._conv[rid]]
        if turns:
            nxt = turns.popleft()
            delay = self.think() if self.think is not None else 0.0
            self.at(self.now() + delay, lambda: self._release(nxt))
        # sent from the loop, not from inside the handler that ended the request
        self.at(self.now(), self._send)

    def _release(self, req: SimRequest) -> None:
        self.ready.append(req)
        self._send()

    def _send(self) -> None:
        while self.free and self.ready:
            self.free -= 1
            self.send(self.ready.popleft())
