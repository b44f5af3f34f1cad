"""Links: the router's sockets to its workers, the pools they form, and their stats.

Everything else in the router talks to workers through `send` (never blocking) and reads who
is routable through `pools`; liveness, roles and routing all depend on this module, not on the
core, so none of them closes a loop back to it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import zmq
import zmq.asyncio

from pdserve.router.events import RouterEvents
from pdserve.router.flight import WorkerState
from pdserve.router.step_logs import StepLogs
from pdserve.workers import messages as m

ROLES = ("prefill", "decode", "colocated")


class Links:
    def __init__(self, endpoints: list[str], ctx: zmq.Context | None, events: RouterEvents) -> None:
        # In-process (inproc) workers need the context they were started with.
        self.ctx = zmq.asyncio.Context.shadow(ctx) if ctx is not None else zmq.asyncio.Context()
        self._owns_ctx = ctx is None
        self.events = events
        self.workers = [WorkerState(e, self.socket(e)) for e in endpoints]
        # per worker id, what the process that placed it knows (node, actor, restarts): shown
        # beside the router's own columns in /admin/workers
        self.placement: dict[str, dict[str, Any]] = {}
        self.step_logs = StepLogs(self.send)  # GET /admin/steps; answers via the core's reader

    def add(self, endpoint: str) -> WorkerState:
        """A worker that joins after start-up (a pool grew, or one came back elsewhere)."""
        w = WorkerState(endpoint, self.socket(endpoint))
        self.workers.append(w)  # in place: the core and its modules hold this list
        return w

    def remove(self, w: WorkerState) -> None:
        """Forget a worker for good (drained and stopped, or replaced by a new incarnation)."""
        self.workers.remove(w)
        w.sock.close(0)
        if w.hb is not None:
            w.hb.close(0)
            w.hb = None

    def socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    def send(self, w: WorkerState, msg: object) -> None:
        # never block the event loop on a dead peer: its queue fills, the message is dropped
        try:
            w.sock.send(m.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.events.count("send_dropped")

    def pools(self) -> dict[str, list[WorkerState]]:
        """Routable workers by role: healthy and not draining."""
        return {
            role: [w for w in self.workers if w.healthy and not w.draining and w.role == role]
            for role in ROLES
        }

    async def hello(self, w: WorkerState) -> None:
        """Introduce the router (at start-up or when a worker joins): answered with WorkerInfo."""
        await w.sock.send(m.encode(m.Hello("router")))

    async def greeted(self, w: WorkerState, deadline: float, timeout_s: float) -> None:
        """Wait for the worker's answer to `hello` (its WorkerInfo); RuntimeError by `deadline`."""
        while w.info is None:
            left = deadline - time.monotonic()
            if left <= 0 or not await w.sock.poll(int(left * 1000)):
                raise RuntimeError(f"worker at {w.endpoint} did not answer within {timeout_s}s")
            msg = m.decode(await w.sock.recv())
            if isinstance(msg, m.WorkerInfo):
                w.info, w.healthy, w.last_seen = msg, True, time.monotonic()

    def find(self, worker_id: str) -> WorkerState | None:
        return next((w for w in self.workers if w.worker_id == worker_id), None)

    async def poll_stats(self, interval_s: float, deadline_s: float) -> None:
        """Ask every worker for its stats each `interval_s`; a worker without a heartbeat
        socket is judged by whether it answers."""
        while True:
            now = time.monotonic()
            for w in self.workers:
                silent = now - w.last_seen > 3 * interval_s + deadline_s
                if w.hb is None and silent:
                    w.healthy = False
                self.send(w, m.GetStats())
            await asyncio.sleep(interval_s)

    def table(self) -> list[dict[str, Any]]:
        """One row per worker for /admin/workers and the dashboard."""
        rows = []
        for w in self.workers:
            s = w.stats
            rows.append(
                {
                    "id": w.worker_id,
                    "role": w.role,
                    "url": w.endpoint,
                    "pid": w.info.pid if w.info else None,
                    "healthy": w.healthy,
                    "draining": w.draining,
                    "down_reason": w.down_reason,
                    "loop_age_s": round(w.loop_age, 3),
                    "idle_age_s": round(w.idle_age, 3),  # since a loop turn or a model layer
                    "threads": s.threads,
                    "queue": s.waiting,
                    "running": s.running,
                    "outstanding": w.outstanding,
                    "kv_blocks_used": s.kv_blocks_used,
                    "kv_blocks_total": s.kv_blocks_total,
                    "quantization": s.quantization,
                    "kv_cache_dtype": s.kv_cache_dtype,
                    "decode_matmul": s.decode_matmul,
                    "prefill_format": s.prefill_format,
                    "prefill_isa": s.prefill_isa,
                    **self.placement.get(w.worker_id, {}),
                }
            )
        return rows

    def vitals(self) -> dict[str, dict[str, Any]]:
        """Per worker id: seconds since its last heartbeat reply (since its last message when
        it has no heartbeat socket) and a copy of the last stats it sent (the dashboard's)."""
        now = time.monotonic()
        out = {}
        for w in self.workers:
            heard = w.last_pong if w.hb is not None else w.last_seen
            out[w.worker_id] = {
                "heartbeat_age_s": round(now - heard, 3),
                "stats": dict(w.stats.report),
            }
        return out

    def close(self) -> None:
        for w in self.workers:
            w.sock.close(0)
            if w.hb is not None:
                w.hb.close(0)
        if self._owns_ctx:
            self.ctx.term()


def check_pairing(workers: list[WorkerState]) -> None:
    """Every worker must compute the same KV (the same weights, formats that may pair, one
    layout: WorkerInfo.fingerprint); else ValueError naming what each one runs."""
    infos = [w.info for w in workers if w.info is not None]
    if len({i.fingerprint for i in infos}) <= 1:
        return
    lines = "; ".join(
        f"{i.worker_id} ({i.role}): {i.kv_desc or i.fingerprint.hex()}" for i in infos
    )
    raise ValueError(f"workers whose KV cannot pair (different weights or KV layout): {lines}")
