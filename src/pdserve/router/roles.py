"""Role switching: drain a worker, switch its role, let it rejoin routing — asked for by an
admin (POST /admin/workers/{id}/role) or by the autobalancer, which watches the pools'
pressures (`balancer.pressures`) and moves one worker P<->D with hysteresis. The finer grain,
threads moving between P and D workers on one host, is `thread_moves.ThreadMover`, run here
beside it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

from pdserve.router import balancer, slo
from pdserve.router.events import RouterEvents
from pdserve.router.flight import RequestError, WorkerState
from pdserve.router.links import ROLES, Links
from pdserve.router.thread_moves import ThreadMover
from pdserve.router.threads import ThreadPolicy
from pdserve.workers import messages as m


class Roles:
    def __init__(
        self,
        links: Links,
        events: RouterEvents,
        busy: Callable[[WorkerState], bool],
        *,
        planner: slo.SloPlanner | None,
        autobalancer: balancer.Autobalancer | None,
        interval_s: float,
        drain_timeout_s: float,
        switch_timeout_s: float,
        thread_policy: ThreadPolicy | None = None,
    ) -> None:
        if autobalancer is not None and planner is None:
            raise ValueError("autobalance needs a cost model (a planner)")
        self.links, self.events, self.busy = links, events, busy
        self.planner, self.autobalancer, self.interval_s = planner, autobalancer, interval_s
        self.drain_timeout_s, self.switch_timeout_s = drain_timeout_s, switch_timeout_s
        self.threads: ThreadMover | None = None
        if thread_policy is not None:
            if planner is None:
                raise ValueError("moving threads needs a cost model (a planner)")
            self.threads = ThreadMover(links, events, planner, thread_policy)

    def loops(self) -> list[Coroutine[Any, Any, None]]:
        """The background loops the core runs: the autobalancer's, the thread mover's."""
        jobs = [self.autobalance()] if self.autobalancer is not None else []
        return jobs + ([self.threads.run()] if self.threads is not None else [])

    async def set_role(
        self, worker_id: str, role: str, by: str = "admin", timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Drain `worker_id` (no new requests; those it holds finish), switch its role, and let
        it rejoin routing. Raises RequestError: 404 unknown, 409 busy/unhealthy/not drained."""
        w = self.links.find(worker_id)
        if w is None:
            raise RequestError(f"no worker {worker_id!r}", 404, "not_found")
        if role not in ROLES:
            raise RequestError(f"unknown role {role!r}", 400, "invalid_value")
        if w.role != role:
            if w.draining or not w.healthy:
                why = "is already switching" if w.draining else "is not healthy"
                raise RequestError(f"worker {worker_id} {why}", 409, "conflict")
            w.draining = True
            try:
                await self._drain(w, timeout_s or self.drain_timeout_s)
                await self._switch(w, role)
            finally:
                w.draining = False
            self.events.role_switch(by)
        return next(r for r in self.links.table() if r["id"] == worker_id)

    async def _drain(self, w: WorkerState, timeout_s: float) -> None:
        ends = time.monotonic() + timeout_s
        while self.busy(w) or w.stats.transfers_out or w.stats.transfers_in:
            if time.monotonic() > ends:
                msg = f"worker {w.worker_id} did not drain within {timeout_s:g}s"
                raise RequestError(msg, 409, "conflict")
            if not w.healthy:
                raise RequestError(
                    f"worker {w.worker_id} went down while draining", 409, "conflict"
                )
            await asyncio.sleep(0.05)

    async def _switch(self, w: WorkerState, role: str) -> None:
        self.links.send(w, m.SetRole(role))  # answered with WorkerInfo, which the core stores
        ends = time.monotonic() + self.switch_timeout_s
        while w.role != role:
            if time.monotonic() > ends:
                raise RequestError(f"worker {w.worker_id} did not switch roles", 409, "conflict")
            await asyncio.sleep(0.02)

    def dispatched(self) -> None:
        """A prompt was booked on its workers: the thread mover samples at once
        (`ThreadMover.poke`), so a count it changes reaches P before the prompt does."""
        if self.threads is not None:
            self.threads.poke()

    def acknowledged(self, before: int | None, after: int | None) -> None:
        """A worker reported its thread count: a changed one lets the grows that waited on it go
        at once rather than at the next sample."""
        if self.threads is not None and before != after:
            self.threads.poke()

    def pool_sample(self, now: float) -> balancer.PoolSample:
        """The autobalancer's view of the pools (an empty pool's work runs on the other)."""
        assert self.planner is not None
        pools = self.links.pools()
        everyone = pools["prefill"] + pools["decode"]
        return balancer.pressures(
            [w.load for w in pools["prefill"] or everyone],
            [w.load for w in pools["decode"] or everyone],
            self.planner,
            now,
            len(pools["prefill"]),
            len(pools["decode"]),
        )

    async def autobalance(self) -> None:
        assert self.autobalancer is not None
        while True:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            if any(w.draining for w in self.links.workers):
                continue
            move = self.autobalancer.observe(now, self.pool_sample(now))
            if move is None:
                continue
            src, dst = ("decode", "prefill") if move == "to_prefill" else ("prefill", "decode")
            pool = self.links.pools()[src]
            if not pool:
                continue
            w = min(pool, key=lambda x: (x.outstanding, x.worker_id))  # the quickest to drain
            self.events.count(f"autobalance_{move}")
            with contextlib.suppress(RequestError):
                await self.set_role(w.worker_id, dst, by="autobalance")
