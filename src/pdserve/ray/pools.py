"""The driver's side of pdserve on Ray: start worker actors, watch them, rejoin restarted ones,
resize the pools.

Life of a member (one worker actor):
  1. starting  -- the actor is created with its role's placement (placement.py) and
                  `max_restarts`; its first `info()` gives the endpoints; the router adds it.
  2. up        -- a watcher task asks `info()` every `poll_s`. While Ray restarts the actor
                  (its process or its node died) the call waits; the router's heartbeats have
                  already taken the worker out of routing and recovered its requests.
  3. rejoined  -- `info()` answers with a new incarnation (new node, new ports): the old
                  router entry is removed and the new endpoint added under the same worker id
                  (`ray_restarts` counted, shown per worker in /admin/workers).
  4. draining  -- a pool shrinks: no new requests; running ones finish (or, past
                  `drain_timeout_s`, are recovered elsewhere); then the worker is removed
                  from the router and the actor killed for good.
Every change is counted in the router's counters (`pool_*`, `ray_restarts`) and listed by
`status()` (GET /admin/pools).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import WorkerConfig
from pdserve.deployment import Deployment, RayConfig
from pdserve.ray.pending import ClusterView, RayView, pending_reasons
from pdserve.ray.placement import MAX_POOL, RESOURCES, fits, placement
from pdserve.ray.scaling import POOLS, PoolAutoscaler
from pdserve.router.flight import RequestError

log = logging.getLogger("pdserve.ray")


@dataclass(frozen=True)
class PoolSpec:
    """What every worker actor of this deployment gets."""

    engine_args: dict[str, Any] = field(default_factory=dict)
    worker_config: WorkerConfig = field(default_factory=WorkerConfig)
    role_configs: dict[str, WorkerConfig] = field(default_factory=dict)  # per role, if differs
    role_engine_args: dict[str, dict[str, Any]] = field(default_factory=dict)  # overrides
    cpus_per_worker: float = 1.0
    max_restarts: int = -1  # Ray restarts a dead worker actor this often (-1: always)
    loopback: bool = False  # bind 127.0.0.1 (every node on this machine) instead of the node IP
    start_timeout_s: float = 300.0  # a new worker not up by then is given up (and counted)
    drain_timeout_s: float = 60.0  # then a draining worker's requests are recovered elsewhere
    poll_s: float = 0.5

    @classmethod
    def of(cls, d: Deployment, loopback: bool) -> PoolSpec:
        """The actors of deployment `d`: its engine arguments (threads: as the topology gives,
        else the actor's CPUs), worker config, per-role overrides and Ray settings."""
        ray = d.ray or RayConfig(cpus_per_worker=1.0)  # no Ray settings: one CPU a worker
        base = {"model": d.model, **d.engine} if d.model is not None else dict(d.engine)
        return cls(
            engine_args={**base, "threads": d.topology.threads},
            worker_config=d.worker,
            role_engine_args=dict(d.roles),
            cpus_per_worker=ray.worker_cpus(d.topology.workers),
            max_restarts=ray.max_restarts,
            loopback=loopback,
        )

    def engine_for(self, role: str) -> dict[str, Any]:
        return {**self.engine_args, **self.role_engine_args.get(role, {})}


@dataclass
class Member:
    worker_id: str
    role: str
    actor: Any
    origin: str  # start | admin | autobalance | replacement
    state: str = "starting"  # starting | up | restarting | draining
    info: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0
    watcher: asyncio.Task | None = None

    def placement_row(self) -> dict[str, Any]:
        return {
            "ray_node": str(self.info.get("node_id", ""))[:12],
            "ray_restarts": self.restarts,
            "origin": self.origin,
        }


def actor_class() -> Any:
    import ray

    from pdserve.ray.actor import WorkerActor

    return ray.remote(WorkerActor)


class RayPools:
    """Worker actors of one deployment; `attach(core)` before anything joins or resizes."""

    def __init__(
        self,
        spec: PoolSpec,
        secret: bytes | None,
        autoscaler: PoolAutoscaler | None = None,
        view: ClusterView | None = None,
    ) -> None:
        import ray

        self.ray, self.spec, self._secret = ray, spec, secret
        self.view = view or RayView(ray)  # what Ray has free, and whether it placed an actor
        self.members: list[Member] = []
        self.core: Any = None
        self._cls = actor_class()
        self._ids = {role: itertools.count() for role in RESOURCES}
        self._tasks: set[asyncio.Task] = set()
        self.autoscaler = autoscaler  # --autobalance: grow/shrink pools (scaling.py)

    # ---- start ---------------------------------------------------------------------------------
    def start(self, counts: dict[str, int], timeout_s: float | None = None) -> list[str]:
        """Create the first workers and wait (blocking) for their endpoints, for the router."""
        members = [self._create(role, "start") for role, n in counts.items() for _ in range(n)]
        refs = [mem.actor.info.remote() for mem in members]
        infos = self.ray.get(refs, timeout=timeout_s or self.spec.start_timeout_s)
        for mem, info in zip(members, infos, strict=True):
            mem.info, mem.state = info, "up"
        return [mem.info["control"] for mem in members]

    def _create(self, role: str, origin: str) -> Member:
        if role not in RESOURCES:
            raise ValueError(f"role must be one of {', '.join(RESOURCES)}, got {role!r}")
        worker_id = self._next_id(role)
        where = placement(role, self.view.cluster_resources(), self.spec.cpus_per_worker)
        actor = self._cls.options(
            name=None, max_restarts=self.spec.max_restarts, **where.options()
        ).remote(
            role,
            worker_id,
            self.spec.engine_for(role),
            dataclasses.asdict(self.spec.role_configs.get(role, self.spec.worker_config)),
            self._secret,
            self.spec.loopback,
        )
        mem = Member(worker_id, role, actor, origin)
        self.members.append(mem)
        return mem

    def _next_id(self, role: str) -> str:
        taken = {m.worker_id for m in self.members}
        while True:
            wid = f"{role[0].upper()}{next(self._ids[role])}"
            if wid not in taken:
                return wid

    # ---- supervision -----------------------------------------------------------------------
    async def attach(self, core: Any) -> None:
        """Watch every member from now on; members started before the router are in it."""
        self.core = core
        for mem in self.members:
            core.links.placement[mem.worker_id] = mem.placement_row()
            mem.watcher = self._spawn(self._watch(mem))
        if self.autoscaler is not None:
            self._spawn(self._autoscale(self.autoscaler, core.config.autobalance_interval_s))

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("pool task failed", exc_info=task.exception())
            self._count("pool_task_errors")

    async def _watch(self, mem: Member) -> None:
        ray = self.ray
        while mem.state != "draining":
            try:
                timeout = self.spec.start_timeout_s if mem.state == "starting" else None
                info = await asyncio.wait_for(_awaitable(mem.actor.info.remote()), timeout)
            except TimeoutError:
                log.error("worker %s did not start within %gs", mem.worker_id, timeout)
                self._count("pool_start_failed")
                await self._stop(mem, kill_only=True)
                return
            except ray.exceptions.RayActorError as e:
                if mem.state == "starting" and "creation task" in str(e):
                    log.error("worker %s cannot start: %s", mem.worker_id, e)
                    self._count("pool_start_failed")
                    await self._stop(mem, kill_only=True)
                    return
                if mem.state == "up":
                    mem.state = "restarting"  # Ray restarts it; the router already took it out
                await asyncio.sleep(self.spec.poll_s)
                continue
            if info["incarnation"] != mem.info.get("incarnation"):
                await self._join(mem, info)
            await asyncio.sleep(self.spec.poll_s)

    async def _join(self, mem: Member, info: dict[str, Any]) -> None:
        """Enter the router: a new worker, or a new incarnation of a restarted one."""
        core = self.core
        restarted = bool(mem.info)
        old = core.links.find(mem.worker_id)
        if old is not None:
            core.remove_worker(old, "restarted")
        try:
            await core.add_worker(info["control"], timeout_s=60.0)
        except RuntimeError as e:
            log.error("worker %s did not answer the router: %s", mem.worker_id, e)
            return  # asked again at the next poll (mem.info unchanged)
        mem.info, mem.state = info, "up"
        if restarted:
            mem.restarts += 1
            self._count("ray_restarts")
            log.warning("worker %s rejoined from node %s", mem.worker_id, info["node_id"][:8])
        core.links.placement[mem.worker_id] = mem.placement_row()

    def _count(self, name: str) -> None:
        if self.core is not None:
            self.core.events.count(name)

    # ---- resize --------------------------------------------------------------------------------
    def resize(self, targets: dict[str, int], by: str = "admin") -> dict[str, Any]:
        """Grow or drain pools toward `targets` (role -> workers); returns at once with the
        plan (`status()`); the workers join or leave in the background."""
        for role, n in targets.items():
            if role not in RESOURCES:
                raise RequestError(f"unknown pool {role!r}", 400, "invalid_value")
            if not 0 <= n <= MAX_POOL:
                raise RequestError(f"{role} must be 0..{MAX_POOL}, got {n}", 400, "invalid_value")
        after = {**self.live_counts(), **targets}
        if after["colocated"] == 0 and (after["prefill"] == 0 and after["decode"] == 0):
            raise RequestError("that would leave no worker to serve", 400, "invalid_value")
        for role, n in targets.items():
            live = [m for m in self.members if m.role == role and m.state != "draining"]
            for _ in range(n - len(live)):
                self._grow(role, by)
            for mem in self._drain_order(live)[: max(0, len(live) - n)]:
                self._shrink(mem, by)
        return self.status()

    def _grow(self, role: str, by: str) -> Member:
        mem = self._create(role, by)
        self._count(f"pool_added_{role}")
        mem.watcher = self._spawn(self._watch(mem))
        return mem

    def _shrink(self, mem: Member, by: str) -> None:
        starting, mem.state = mem.state == "starting", "draining"
        self._count(f"pool_drained_{mem.role}")
        # one still starting holds no request: stop it now, before it takes a restarting
        # worker's resources
        self._spawn(self._stop(mem, kill_only=True) if starting else self._drain(mem))

    def _drain_order(self, live: list[Member]) -> list[Member]:
        """Starting ones first, then the least busy, the newest first among equals."""

        def busy(mem: Member) -> int:
            w = self.core.links.find(mem.worker_id) if self.core is not None else None
            return w.outstanding if w is not None else -1

        return sorted(live, key=lambda mem: (busy(mem), -self.members.index(mem)))

    async def _drain(self, mem: Member) -> None:
        w = self.core.links.find(mem.worker_id) if self.core is not None else None
        if w is not None:
            clean = await self.core.drain_worker(w, self.spec.drain_timeout_s)
            if not clean:
                self._count("pool_drain_timeouts")  # its requests are recovered elsewhere
            self.core.remove_worker(w, "drained")
        await self._stop(mem)

    async def _stop(self, mem: Member, kill_only: bool = False) -> None:
        """End the actor for good (no restart) and forget the member."""
        if mem.watcher is not None and mem.watcher is not asyncio.current_task():
            mem.watcher.cancel()
        if not kill_only:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(_awaitable(mem.actor.shutdown.remote()), 15.0)
        self.ray.kill(mem.actor, no_restart=True)
        if mem in self.members:
            self.members.remove(mem)
        if self.core is not None:
            self.core.links.placement.pop(mem.worker_id, None)

    async def _autoscale(self, policy: PoolAutoscaler, interval_s: float) -> None:
        """Each `interval_s`: grow a saturated pool when Ray has room, shrink an idle one."""
        while True:
            await asyncio.sleep(interval_s)
            if any(mem.state in ("starting", "draining") for mem in self.members):
                continue  # one change at a time: let the last settle
            now = time.monotonic()
            room = await asyncio.to_thread(lambda: {r: self.room(r) for r in POOLS})
            move = policy.observe(now, self.core.pool_sample(now), room)
            if move is None:
                continue
            kind, role = move
            self._count(f"autoscale_{kind}_{role}")
            n = self.live_counts()[role] + (1 if kind == "grow" else -1)
            with contextlib.suppress(RequestError):
                self.resize({role: n}, by="autobalance")

    # ---- status and the end --------------------------------------------------------------------
    def live_counts(self) -> dict[str, int]:
        return {
            role: sum(1 for m in self.members if m.role == role and m.state != "draining")
            for role in RESOURCES
        }

    def room(self, role: str) -> bool:
        """Whether the cluster has free resources for one more worker of `role` now."""
        where = placement(role, self.view.cluster_resources(), self.spec.cpus_per_worker)
        return fits(where, self.view.available_resources())

    def pending(self) -> list[dict[str, str]]:
        """The starting workers Ray has not placed yet, each with the resource it waits for."""
        starting = [(m.worker_id, m.role, m.actor) for m in self.members if m.state == "starting"]
        try:
            return pending_reasons(starting, self.view, self.spec.cpus_per_worker)
        except Exception:  # Ray unreachable for a moment: /admin/pools and the dashboard answer
            log.warning("cannot ask Ray why workers wait", exc_info=True)
            return []

    def status(self) -> dict[str, Any]:
        """GET /admin/pools: per pool its target and members by state; `pending`: the workers
        Ray cannot place yet and why ("needs CPU 1.0, 0 free")."""
        pools = {}
        pending = self.pending()
        for role in RESOURCES:
            mine = [m for m in self.members if m.role == role]
            waiting = sum(1 for p in pending if p["role"] == role)
            pools[role] = {
                "target": self.live_counts()[role],
                "up": sum(1 for m in mine if m.state == "up"),
                "starting": sum(1 for m in mine if m.state == "starting") - waiting,
                "pending": waiting,
                "restarting": sum(1 for m in mine if m.state == "restarting"),
                "draining": sum(1 for m in mine if m.state == "draining"),
                "workers": [m.worker_id for m in mine],
            }
        counters = self.core.counters if self.core is not None else {}
        changes = {
            k: int(v)
            for k, v in counters.items()
            if k.startswith(("pool_", "ray_restarts", "autoscale_"))
        }
        return {
            "object": "pools",
            "backend": "ray",
            "pools": pools,
            "pending": pending,
            "changes": changes,
        }

    async def close(self) -> None:
        """Stop every worker actor (the router is closing)."""
        for task in list(self._tasks):
            task.cancel()
        for mem in list(self.members):
            with contextlib.suppress(Exception):
                await self._stop(mem)


def _awaitable(ref: Any) -> Any:
    """An ObjectRef as an asyncio future (Ray's refs are awaitable; wait_for wants a future)."""
    return asyncio.wrap_future(ref.future())
