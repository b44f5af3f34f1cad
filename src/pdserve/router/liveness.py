"""Liveness: heartbeats to every worker, and the verdicts.

Every `interval_s` each worker's heartbeat socket gets a Ping (answered by a thread of the
worker, so a long engine step does not look like death). A worker silent for `timeout_s`, or
whose main loop has not turned for `stuck_s`, is reported through `on_down(worker, reason)` —
the core takes it out of routing and recovers its requests. A worker that answers again
rejoins routing here. Unhealthy workers get a Hello every other round, so a restarted one
answers with its new heartbeat address.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import zmq

from pdserve.router.events import RouterEvents
from pdserve.router.flight import WorkerState
from pdserve.router.links import Links
from pdserve.workers import messages as m


class Liveness:
    def __init__(
        self,
        links: Links,
        events: RouterEvents,
        on_down: Callable[[WorkerState, str], None],
        *,
        interval_s: float,
        timeout_s: float,
        stuck_s: float,
    ) -> None:
        self.links, self.events, self.on_down = links, events, on_down
        self.interval_s, self.timeout_s, self.stuck_s = interval_s, timeout_s, stuck_s
        self._readers: dict[str, asyncio.Task] = {}  # worker endpoint -> its heartbeat reader

    def connect(self, w: WorkerState, endpoint: str) -> None:
        """(Re)connect `w`'s heartbeat socket, e.g. after a restart gave it a new port."""
        old = self._readers.pop(w.endpoint, None)
        if old is not None:
            old.cancel()
        if w.hb is not None:
            w.hb.close(0)
        w.hb, w.last_pong = self.links.socket(endpoint), time.monotonic()
        self._readers[w.endpoint] = asyncio.create_task(self._reader(w))

    def disconnect(self, w: WorkerState) -> None:
        """Stop watching `w` (it leaves the router)."""
        old = self._readers.pop(w.endpoint, None)
        if old is not None:
            old.cancel()

    def tasks(self) -> list[asyncio.Task]:
        return list(self._readers.values())

    async def run(self) -> None:
        seq, last_round = 0, time.monotonic()
        while True:
            seq += 1
            now = time.monotonic()
            # If this loop itself was held up (a blocking call on the event loop), the pongs
            # could not be read either: judge no one this round.
            stalled = now - last_round > self.timeout_s / 2
            last_round = now
            for w in self.links.workers:
                self._round(w, seq, now, stalled)
            await asyncio.sleep(self.interval_s)

    def _round(self, w: WorkerState, seq: int, now: float, stalled: bool) -> None:
        if not w.healthy and seq % 2 == 0:
            # a restarted worker answers Hello with its new heartbeat address
            self.links.send(w, m.Hello("router"))
        if w.hb is None:
            return
        with contextlib.suppress(zmq.Again):
            w.hb.send(m.encode(m.Ping(seq)), zmq.NOBLOCK)
        if not w.healthy or stalled:
            if stalled:
                w.last_pong = max(w.last_pong, now - self.interval_s)
            return
        if now - w.last_pong > self.timeout_s:
            self.on_down(w, "no_heartbeat")
        elif w.idle_age > self.stuck_s:
            self.on_down(w, "stuck")

    async def _reader(self, w: WorkerState) -> None:
        assert w.hb is not None
        while True:
            raw = await w.hb.recv()
            try:
                pong = m.decode(raw)
            except m.MessageError:
                self.events.count("bad_messages")
                continue
            if not isinstance(pong, m.Pong):
                continue
            w.last_pong, w.loop_age = time.monotonic(), pong.loop_age_s
            w.work_age = pong.work_age_s
            if w.down_reason is not None and w.idle_age <= self.stuck_s:
                self._up(w)

    def _up(self, w: WorkerState) -> None:
        self.events.count("workers_up")
        w.down_reason, w.healthy, w.last_seen = None, True, time.monotonic()
        w.outstanding = 0  # its requests were all recovered elsewhere
        self.links.send(w, m.Hello("router"))  # learn its identity again: it may have restarted
