"""`LocalCluster`: real prefill/decode/colocated workers on this machine, driven in-process.

    with LocalCluster(prefill=1, decode=1, transport="tcp") as cluster:
        outs = cluster.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))

    with LocalCluster(deployment=Deployment.from_yaml("deploy.yaml")) as cluster: ...

Workers are child processes (`pdserve worker ...`), or threads of this process for the `inproc`
transport. Requests go through the same `RouterCore` as the HTTP server (run on an event loop in
a background thread), so tests and benchmarks exercise the serving path: P/D choice, hand-off,
one retry that resumes after the tokens already produced, deadlines, timelines. The cluster also
keeps a plain control socket per worker for stats and fault injection.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from pdserve.config import RouterConfig, WorkerConfig
from pdserve.costmodel.model import CostModel
from pdserve.deployment import Deployment, PlannerConfig, Topology
from pdserve.engine import loader, step_log
from pdserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pdserve.engine.request import SamplingParams
from pdserve.engine.step_log import StepRecord
from pdserve.launcher import Launched, WorkerSpec, await_ready, launch, relaunch, stop
from pdserve.router import timeline as tl
from pdserve.router.core import RequestError, RouterCore
from pdserve.serve import plan
from pdserve.workers import auth
from pdserve.workers import messages as m

ACKED = tl.staged(tl.Side.SEND, "acked")  # P's stamp: D acknowledged the KV

STARTUP_TIMEOUT_S = 180.0


@dataclass
class WorkerHandle:
    launched: Launched
    sock: zmq.Socket | None = None
    info: m.WorkerInfo | None = None
    state: str = "up"  # "up" | "killed" | "stalled" (fault injection)

    @property
    def worker_id(self) -> str:
        return self.launched.spec.worker_id

    @property
    def role(self) -> str:
        return self.launched.spec.role


class LocalCluster:
    def __init__(
        self,
        model: str | None = None,
        prefill: int = 1,
        decode: int = 1,
        colocated: int = 0,
        transport: str = "tcp",
        kv_codec: str = "none",
        *,
        deployment: Deployment | None = None,
        threads: int | None = None,
        handoff_tokens: int = 1,
        deadline_s: float = 5.0,
        lease_s: float = 10.0,
        max_retries: int = 1,
        shm_mb: int = 512,
        stream_kv: bool = True,
        engine_args: dict[str, Any] | None = None,
        prefill_args: dict[str, Any] | None = None,
        decode_args: dict[str, Any] | None = None,
        core_args: dict[str, Any] | None = None,
        kv_pool: dict[str, Any] | None = None,
        pool_factory: Any = None,
        name: str = "",
    ) -> None:
        """`deployment`: the whole description (deployment.py), the arguments before `threads`
        and after it up to `kv_pool` then unused; without it they make one (`kv_pool`:
        WorkerConfig's kv_pool_* fields, the real tiers). `core_args`: RouterCore options
        (liveness timeouts, a planner ...) over the deployment's; `pool_factory`: builds each
        inproc worker's pool instead (tests: one shared fake); `name`: prefixes the worker ids
        (two inproc clusters in one process need it)."""
        if deployment is None:
            deployment = Deployment(
                model=model,
                topology=Topology(prefill, decode, colocated, threads),
                engine=dict(engine_args or {}),
                roles={r: a for r, a in (("prefill", prefill_args), ("decode", decode_args)) if a},
                worker=WorkerConfig(
                    transport=transport,
                    kv_codec=kv_codec,
                    deadline_s=deadline_s,
                    lease_s=lease_s,
                    shm_mb=shm_mb,
                    stream_kv=stream_kv,
                    **(kv_pool or {}),
                ),
                # round robin: tests and benchmarks want a deterministic spread, and no 429s
                router=RouterConfig(
                    policy="round_robin",
                    deadline_s=deadline_s,
                    max_retries=max_retries,
                    handoff_tokens=handoff_tokens,
                    max_inflight=1 << 20,
                ),
                planner=PlannerConfig(cost_model="none"),  # a planner comes in core_args
            )
        self.deployment = d = deployment
        self.model, self.counts = d.model, d.topology.counts()
        self.threads = d.topology.worker_threads()
        self.worker_config, self.router_config = d.worker, d.router
        self.pool_factory, self.name = pool_factory, name
        self.core_args = dict(core_args or {})
        self.workers: list[WorkerHandle] = []
        inproc = d.worker.transport == "inproc"
        self.ctx = zmq.Context.instance() if inproc else zmq.Context()
        self._ids = itertools.count()
        self.tokenizer: Any = None
        self.core: RouterCore | None = None
        self._cost: CostModel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- life cycle --------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        # the workers inherit $PDSERVE_SECRET; this process (the router core) tags with it too
        m.set_key(auth.load_secret())
        self._load()
        for spec in self.worker_specs():
            self.workers.append(self.spawn(spec))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for w in self.workers:
            await_ready(w.launched, deadline)
            self._connect(w, deadline)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="cluster-router", daemon=True
        )
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start_core(), self._loop).result()

    def _load(self) -> None:
        """The tokenizer, and the cost model when the deployment names one (then the router
        gets its planner and decoding workers their stall-free budget)."""
        self.tokenizer = loader.load_tokenizer(loader.resolve_model(self.model))
        self._cost = plan.cost_model(self.deployment, self.threads, may_profile=False)

    async def _start_core(self) -> None:
        endpoints = [w.launched.control for w in self.workers]
        self.core = self._router_core(endpoints)
        await self.core.start(timeout_s=STARTUP_TIMEOUT_S)

    def _router_core(self, endpoints: list[str]) -> RouterCore:
        core_args = dict(self.core_args)
        return plan.router_core(self.deployment, endpoints, self._cost, self.ctx, **core_args)

    def worker_specs(self) -> list[WorkerSpec]:
        """The deployment's workers, ids prefixed with the cluster's name."""
        specs = [
            dataclasses.replace(
                s, worker_id=self.name + s.worker_id, pool_factory=self.pool_factory
            )
            for s in plan.worker_specs(self.deployment, self.threads)
        ]
        return plan.with_stall_free(self.deployment, specs, self._cost, self.threads)

    def spawn(self, spec: WorkerSpec) -> WorkerHandle:
        """Start one worker process (a subclass may start it elsewhere: another network
        namespace, a wrapper command; tests/workers/test_netns.py does)."""
        return WorkerHandle(launch(spec, self.ctx))

    def _connect(self, w: WorkerHandle, deadline: float) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(w.launched.control)
        w.sock = sock
        sock.send(m.encode(m.Hello("local-cluster", subscribe=False)))  # the core subscribes
        msg = self._recv_from(w, deadline)
        if not isinstance(msg, m.WorkerInfo):
            raise RuntimeError(f"worker {w.worker_id} answered Hello with {msg!r}")
        w.info = msg

    def _recv_from(self, w: WorkerHandle, deadline: float) -> Any:
        assert w.sock is not None
        if not w.sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            raise TimeoutError(f"worker {w.worker_id} did not answer")
        return m.decode(w.sock.recv())

    def close(self) -> None:
        if self._loop is not None:
            if self.core is not None:
                asyncio.run_coroutine_threadsafe(self.core.close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._loop.close()
            self._loop = None
        for w in self.workers:
            if w.state == "stalled":
                self.resume(w.worker_id)  # a stopped process would not hear Shutdown
            if w.sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    w.sock.send(m.encode(m.Shutdown()), zmq.NOBLOCK)
        for w in self.workers:
            stop(w.launched)
            if w.sock is not None:
                w.sock.close(0)
                w.sock = None
        self.workers = []

    # ---- requests ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | list[int]] | str,
        params: SamplingParams | None = None,
        timeout_s: float | None = None,
        user: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts concurrently through the router core; a failed request comes back with
        finish_reason "error" and `error` set, never as an exception or a hang. `user`: the
        conversation they belong to (the OpenAI `user` field)."""
        return self.submit(prompts, params, user)[1].result(timeout=timeout_s)

    def submit(
        self,
        prompts: Sequence[str | list[int]] | str,
        params: SamplingParams | None = None,
        user: str | None = None,
    ) -> tuple[list[str], concurrent.futures.Future[list[RequestOutput]]]:
        """`generate` without waiting: the request ids and a future of the outputs."""
        params = params or SamplingParams()
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        rids = [f"c{next(self._ids)}" for _ in batch]
        jobs = [self._one(rid, p, params, user) for rid, p in zip(rids, batch, strict=True)]
        assert self._loop is not None
        return rids, asyncio.run_coroutine_threadsafe(_gather(jobs), self._loop)

    def pair_of(self, rid: str) -> tuple[str, str | None] | None:
        """Ids of the workers serving request `rid` now (P and D, or one worker and None)."""
        assert self.core is not None
        flight = self.core.flights.get(rid)
        if flight is None or flight.pair is None:
            return None
        first, second = flight.pair
        return first.worker_id, second.worker_id if second is not None else None

    async def _one(
        self, rid: str, prompt: str | list[int], params: SamplingParams, user: str | None
    ) -> RequestOutput:
        assert self.core is not None
        ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        arrival = time.monotonic()
        choices = [CompletionOutput(i, "", []) for i in range(params.n)]
        error = None
        try:
            async for d in self.core.generate(rid, ids, params, session=user):
                c = choices[d.index]
                c.token_ids += d.token_ids
                c.text += d.text
                if d.logprobs:
                    c.logprobs = (c.logprobs or []) + d.logprobs
                c.finish_reason, c.stop_reason = d.finish_reason or c.finish_reason, d.stop_reason
        except RequestError as e:
            for c in choices:
                c.finish_reason = "error"
            error = e.message
        timeline = await self._complete_timeline(rid, error is None)
        first = tl.first(timeline, tl.Ev.FIRST_TOKEN)
        metrics = RequestMetrics(arrival, first_token_time=first, finished_time=time.monotonic())
        return RequestOutput(
            rid,
            prompt if isinstance(prompt, str) else None,
            ids,
            choices,
            True,
            metrics,
            error=error,
            timeline=timeline,
        )

    async def _complete_timeline(self, rid: str, ok: bool) -> list[tuple[str, str, float]]:
        """P reports its side of a hand-off after D's ack, which can trail the last token by a
        moment: wait briefly for it so every timeline shows both sides."""
        assert self.core is not None
        for _ in range(50):
            timeline = self.core.raw_timeline(rid) or []
            handed_off = any(tl.kind_of(e) == tl.Side.RECV for e, _, _ in timeline)
            if not ok or not handed_off or tl.first(timeline, ACKED) is not None:
                return timeline
            await asyncio.sleep(0.01)
        return timeline

    @property
    def stats(self) -> collections.Counter[str]:
        """The core's counters: retries, requests by outcome, KV bytes and frames per side."""
        assert self.core is not None
        return self.core.counters

    # ---- introspection and faults ------------------------------------------------------------
    def worker_stats(self) -> dict[str, dict[str, Any]]:
        """Stats of every worker that is up (killed and stalled ones cannot answer)."""
        out = {}
        for w in self.workers:
            if w.state != "up":
                continue
            self._send(w, m.GetStats())
            msg = self._recv_until(w, m.Stats)
            out[w.worker_id] = msg.stats
        return out

    def step_logs(self, since: float = 0.0) -> dict[str, list[StepRecord]]:
        """Every up worker's engine steps that began at or after `since` (time.monotonic())."""
        out = {}
        for w in self.workers:
            if w.state != "up":
                continue
            self._send(w, m.GetSteps(since))
            msg = self._recv_until(w, m.Steps)
            out[w.worker_id] = step_log.from_wire(msg.steps, msg.threads)
        return out

    def _recv_until(self, w: WorkerHandle, kind: type) -> Any:
        deadline = time.monotonic() + 10
        while True:
            msg = self._recv_from(w, deadline)
            if isinstance(msg, kind):
                return msg

    def _send(self, w: WorkerHandle, msg: object) -> None:
        assert w.sock is not None
        w.sock.send(m.encode(msg))

    def set_fault(self, worker_id: str, mode: str, count: int = 1, delay_s: float = 0.0) -> None:
        self._send(self._worker(worker_id), m.SetFault(mode, count, delay_s))

    def _worker(self, worker_id: str) -> WorkerHandle:
        for w in self.workers:
            if w.worker_id == worker_id:
                return w
        raise ValueError(f"no worker {worker_id!r}; have {[w.worker_id for w in self.workers]}")

    def _signal(self, worker_id: str, sig: signal.Signals, state: str) -> None:
        w = self._worker(worker_id)
        if w.launched.proc is None:
            raise ValueError("kill/stall/resume need worker processes, not the inproc transport")
        os.kill(w.launched.proc.pid, sig)
        w.state = state

    def kill(self, worker_id: str) -> None:
        """SIGKILL a worker: no goodbye, no cleanup, as when a host dies."""
        self._signal(worker_id, signal.SIGKILL, "killed")

    def stall(self, worker_id: str) -> None:
        """SIGSTOP a worker: alive to the OS, silent to everyone (a hung host or process)."""
        self._signal(worker_id, signal.SIGSTOP, "stalled")

    def resume(self, worker_id: str) -> None:
        self._signal(worker_id, signal.SIGCONT, "up")

    def restart(self, worker_id: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Start a killed worker again on the same addresses; the router sees it rejoin."""
        w = self._worker(worker_id)
        if w.state != "killed":
            raise ValueError(f"worker {worker_id} is {w.state}; only a killed one restarts")
        launched = relaunch(w.launched, self.ctx)
        if w.sock is not None:
            w.sock.close(0)
        await_ready(launched, time.monotonic() + timeout_s)
        w.launched, w.state = launched, "up"
        self._connect(w, time.monotonic() + timeout_s)

    def set_role(self, worker_id: str, role: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Drain a worker, switch its role and let it rejoin (RouterCore.set_role)."""
        assert self.core is not None and self._loop is not None
        job = self.core.set_role(worker_id, role, timeout_s=timeout_s)
        return asyncio.run_coroutine_threadsafe(job, self._loop).result(timeout_s + 10)

    def wait_idle(self, timeout_s: float = 15.0) -> dict[str, dict[str, Any]]:
        """Poll until every worker holds no KV and no transfer; returns the last stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.worker_stats()
            if (
                all(
                    s["kv_blocks_used"] == 0
                    and s["transfers_out"] == 0
                    and s["transfers_in"] == 0
                    and s["running"] == 0
                    and s["waiting"] == 0
                    for s in stats.values()
                )
                or time.monotonic() > deadline
            ):
                return stats
            time.sleep(0.1)


async def _gather(jobs: list[Any]) -> list[RequestOutput]:
    return list(await asyncio.gather(*jobs))
