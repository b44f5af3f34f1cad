"""Workers that share one CPU host: a step slows down while another worker is mid-step.

A step's `work` is its duration alone (`StepModel.step_s`). While it runs, it progresses at
rate 1 / `Contention.slowdown(kind, kinds of the other busy steps)`; whenever a step starts or
ends on the host, every running step's remaining work is brought up to date and its end is
rescheduled at the new rate (processor sharing with measured factors). A step alone ends after
exactly `work`; with the factors at 1 the host changes nothing.

Example (the test computes it by hand): factors prefill x2, decode x1.5. A prefill of work 1.0
starts at 0, a decode of work 0.5 at 0.2. From 0.2 the prefill runs at 1/2 and the decode at
1/1.5: the decode ends at 0.2 + 0.5 x 1.5 = 0.95, when the prefill has 1.0 - 0.2 - 0.75 / 2 =
0.425 left, alone again: it ends at 1.375.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.costmodel.contention import Contention

Schedule = Callable[[float, Callable[[], None]], None]  # Simulation.at


def step_kind(rows: Sequence[tuple[int, int]]) -> str:
    """ "prefill" when the step computes any prompt chunk, else "decode"."""
    return "prefill" if any(n > 1 or start == 0 for n, start in rows) else "decode"


@dataclass
class _Running:
    kind: str
    remaining: float  # seconds of work alone
    rate: float
    since: float
    done: Callable[[], None]
    token: int = 0  # the host's sequence number of its latest end event: older ones are stale


class Host:
    def __init__(
        self, contention: Contention, schedule: Schedule, clock: Callable[[], float]
    ) -> None:
        self.contention = contention
        self.schedule, self.clock = schedule, clock
        self.running: dict[str, _Running] = {}
        # one sequence for the whole host, not per step: a stale end event of a worker's last
        # step must never match the step it starts next (a per-step count restarts at 1, so
        # the old step's superseded end, still queued, used to end the new step early)
        self._tokens = itertools.count(1)

    def start(self, now: float, key: str, kind: str, work: float, done: Callable[[], None]) -> None:
        """Run a step of `work` seconds (alone) for worker `key`; `done()` at its end."""
        if key in self.running:
            raise ValueError(f"worker {key} already has a step running")
        self._advance(now)
        self.running[key] = _Running(kind, work, 1.0, now, done)
        self._reschedule(now)

    def _advance(self, now: float) -> None:
        for r in self.running.values():
            r.remaining = max(0.0, r.remaining - (now - r.since) * r.rate)
            r.since = now

    def _reschedule(self, now: float) -> None:
        for key, r in self.running.items():
            others = [o.kind for k, o in self.running.items() if k != key]
            rate = 1.0 / self.contention.slowdown(r.kind, others)
            if r.token and rate == r.rate:
                continue  # same rate: its end event still holds
            r.rate = rate
            r.token = next(self._tokens)
            self.schedule(now + r.remaining / r.rate, self._ender(key, r.token))

    def _ender(self, key: str, token: int) -> Callable[[], None]:
        return lambda: self._end(key, token)

    def _end(self, key: str, token: int) -> None:
        r = self.running.get(key)
        if r is None or r.token != token:
            return  # rescheduled since
        now = self.clock()
        self._advance(now)
        del self.running[key]
        self._reschedule(now)
        r.done()
