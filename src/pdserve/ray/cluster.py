"""`RayCluster`: `LocalCluster`'s synchronous API (generate, submit, pair_of, stats, set_role)
over worker actors on a Ray cluster the caller has connected to (`ray.init`), for tests and
benchmarks. The router core and the pools (pools.py) run on the cluster's background loop, the
same path as `pdserve serve --ray`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import zmq

from pdserve.cluster import STARTUP_TIMEOUT_S, LocalCluster
from pdserve.ray.pools import PoolSpec, RayPools
from pdserve.ray.scaling import PoolAutoscaler
from pdserve.workers import messages as m


class RayCluster(LocalCluster):
    def __init__(
        self,
        model: str | None = None,
        prefill: int = 1,
        decode: int = 1,
        colocated: int = 0,
        *,
        spec: PoolSpec | None = None,
        secret: bytes | None = None,
        autoscaler: PoolAutoscaler | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, prefill, decode, colocated, **kwargs)
        self.spec = spec or PoolSpec.of(self.deployment, loopback=False)
        self.secret, self.autoscaler = secret, autoscaler
        self.pools: RayPools | None = None

    def start(self) -> None:
        m.set_key(self.secret)
        self._load()
        self.pools = RayPools(self.spec, self.secret, self.autoscaler)
        counts = {role: n for role, n in self.counts.items() if n}
        endpoints = self.pools.start(counts, timeout_s=STARTUP_TIMEOUT_S)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ray-router")
        self._thread.daemon = True
        self._thread.start()
        self._run(self._start_ray_core(endpoints))

    async def _start_ray_core(self, endpoints: list[str]) -> None:
        assert self.pools is not None
        self.core = self._router_core(endpoints)
        await self.core.start(timeout_s=STARTUP_TIMEOUT_S)
        await self.pools.attach(self.core)

    def _run(self, coro: Any, timeout_s: float = STARTUP_TIMEOUT_S) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def close(self) -> None:
        if self.pools is not None and self._loop is not None:
            with contextlib.suppress(Exception):
                self._run(self.pools.close(), 60.0)
        self.pools = None
        super().close()

    # ---- pools ---------------------------------------------------------------------------------
    def resize(self, targets: dict[str, int]) -> dict[str, Any]:
        """POST /admin/pools's work: returns at once, the workers join or leave after."""
        assert self.pools is not None
        pools = self.pools

        async def call() -> dict[str, Any]:
            return pools.resize(targets)

        return self._run(call(), 10.0)

    def table(self) -> list[dict[str, Any]]:
        """/admin/workers's rows (with each worker's Ray node, restarts and origin)."""
        assert self.core is not None
        core = self.core

        async def call() -> list[dict[str, Any]]:
            return core.worker_table()

        return self._run(call(), 10.0)

    def worker_stats(self) -> dict[str, dict[str, Any]]:
        """Stats of every worker the router holds healthy, asked on a socket of our own."""
        out: dict[str, dict[str, Any]] = {}
        if self._loop is None:  # closed: no worker left to ask
            return out
        for row in self.table():
            if row["healthy"]:
                stats = self._ask(row["url"], m.GetStats(), m.Stats)
                if stats is not None:
                    out[row["id"]] = stats.stats
        return out

    def set_fault(self, worker_id: str, mode: str, count: int = 1, delay_s: float = 0.0) -> None:
        row = next(r for r in self.table() if r["id"] == worker_id)
        self._ask(row["url"], m.SetFault(mode, count, delay_s), None)

    def _ask(self, url: str, msg: object, reply: type | None) -> Any:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            sock.connect(url)
            sock.send(m.encode(msg))
            deadline = time.monotonic() + 10
            while reply is not None and sock.poll(
                int(max(0.0, deadline - time.monotonic()) * 1000)
            ):
                got = m.decode(sock.recv())
                if isinstance(got, reply):
                    return got
            return None
        finally:
            sock.close()
