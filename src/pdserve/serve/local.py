"""The local front: `pdserve serve` (worker processes on this machine + the router) and
`pdserve router` (the router alone, in front of workers started elsewhere).

serve: start the workers as child processes, wait until each has loaded the model, serve the
router (http.py), restart a worker process that exits; at shutdown the workers are told to stop.
Internal sockets bind to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import functools
import time

import zmq

from pdserve.deployment import Deployment
from pdserve.launcher import Launched, await_ready, launch, relaunch, stop
from pdserve.router.core import RouterCore
from pdserve.serve import http, plan
from pdserve.workers import messages as m


def run(d: Deployment) -> int:
    """Serve `d` with worker processes here; `d.ray` set: with Ray actors (serve/ray.py)."""
    if d.ray is not None:
        from pdserve.serve import ray as on_ray

        return on_ray.run(d)
    plan.setup_logging()
    threads = d.topology.worker_threads()
    specs = plan.worker_specs(d, threads)
    plan.use_secret(d, [s.config.host for s in specs])
    # before the workers start: profiling (when needed) measures a quiet machine
    cost = plan.cost_model(d, threads)
    d, cost = plan.at_host_level(d, cost, threads)
    specs = plan.with_stall_free(d, specs, cost, threads)
    ctx = zmq.Context()
    workers: list[Launched] = []
    try:
        t0 = time.monotonic()
        workers = [launch(s, ctx) for s in specs]
        for w in workers:
            await_ready(w, t0 + plan.STARTUP_TIMEOUT_S)
        plan.log.info("%d workers ready in %.1fs", len(workers), time.monotonic() - t0)
        watch = functools.partial(supervise, workers, ctx) if d.restart_workers else None
        endpoints = [w.control for w in workers]
        return asyncio.run(http.serve_router(d, endpoints, cost, watch=watch))
    finally:
        shutdown(ctx, workers)


def run_router(d: Deployment, endpoints: list[str]) -> int:
    """The router alone in front of workers started elsewhere (`pdserve worker`)."""
    plan.setup_logging()
    if not endpoints:
        raise ValueError("give worker URLs: --prefill URL... --decode URL... or --colocated URL...")
    plan.use_secret(d, endpoints)
    cost = plan.cost_model(d, 1, may_profile=False)
    return asyncio.run(http.serve_router(d, endpoints, cost))


async def supervise(workers: list[Launched], ctx: zmq.Context, core: RouterCore) -> None:
    """Restart a worker process that exited, on its old addresses, so the router's sockets
    reconnect and the heartbeats bring it back into routing (issue 7: recovery)."""
    while True:
        await asyncio.sleep(1.0)
        for i, w in enumerate(workers):
            if w.proc is None or w.proc.poll() is None or not w.control.startswith("tcp://"):
                continue
            who = w.spec.worker_id
            plan.log.warning("worker %s exited (%s); restarting it", who, w.proc.returncode)
            core.counters["workers_restarted"] += 1
            fresh = relaunch(w, ctx)
            deadline = time.monotonic() + plan.STARTUP_TIMEOUT_S
            try:
                await asyncio.to_thread(await_ready, fresh, deadline)
            except Exception as e:  # keep supervising the others; try this one again later
                plan.log.error("worker %s did not come back: %s", who, e)
            workers[i] = fresh


def shutdown(ctx: zmq.Context, workers: list[Launched]) -> None:
    """Tell every worker to stop, wait for them (killing a child that lingers)."""
    for w in workers:
        if not w.control:
            continue
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(w.control)
        sock.send(m.encode(m.Shutdown()))
        sock.close()
    for w in workers:
        if w.proc is not None and not w.control:
            w.proc.terminate()
        stop(w)
    ctx.term()
