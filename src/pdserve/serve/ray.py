"""The Ray front: `pdserve serve --ray [auto|ADDRESS]`, the router here, every worker a Ray actor.

1. Connect to Ray: `auto` starts a local instance (dashboard off unless asked, a small object
   store: pdserve sends nothing through it); an address joins a running cluster.
2. Start the workers as actors (ray/pools.py) and wait for their endpoints.
3. Serve the router (http.py, the same as without Ray) with the pools attached: Ray restarts
   dead actors, the pools rejoin them, /admin/pools resizes and says why a worker waits.
The shared secret goes to the actors as a constructor argument, never through a command line
or the environment of Ray's processes; it is required unless every worker binds loopback.

A worker's torch threads are the whole CPUs its actor holds, and one below a whole CPU: with
`ray.cpus_per_worker: 0.5` two workers share each core (logged at start).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from pdserve.deployment import Deployment, RayConfig, threads_for_cpus
from pdserve.ray.placement import ray_address
from pdserve.ray.pools import PoolSpec, RayPools
from pdserve.ray.scaling import PoolAutoscaler
from pdserve.serve import http, plan
from pdserve.workers import auth
from pdserve.workers import messages as m

OBJECT_STORE_BYTES = 200 << 20


def pool_spec(d: Deployment) -> tuple[PoolSpec, int]:
    """The actors' spec (with stall-free configs when the planner has a cost model loaded
    later, see `run`) and the torch threads of one worker."""
    ray = d.ray or RayConfig()
    spec = PoolSpec.of(d, loopback=ray.local)
    threads = d.topology.threads or threads_for_cpus(spec.cpus_per_worker)
    if d.topology.threads is None and spec.cpus_per_worker < 1:
        plan.log.info(
            "each worker holds %g Ray CPUs: 1 torch thread, sharing a core with other workers",
            spec.cpus_per_worker,
        )
    return spec, threads


def run(d: Deployment) -> int:
    import ray

    plan.setup_logging()
    config = d.ray or RayConfig()
    address = ray_address(config.address)
    spec, threads = pool_spec(d)
    secret = auth.load_secret(d.http.secret_file)
    # off this machine the workers bind their node's address: authenticated or not at all
    auth.require_secret(["127.0.0.1" if config.local else "ray-cluster-nodes"], secret)
    m.set_key(secret)
    cost = plan.cost_model(d, threads)
    stall_free = plan.with_stall_free(d, plan.worker_specs(d, threads), cost, threads)
    spec = dataclasses.replace(spec, role_configs={s.role: s.config for s in stall_free})
    if address is None:
        ray.init(
            include_dashboard=config.dashboard,
            object_store_memory=OBJECT_STORE_BYTES,
            logging_level=logging.WARNING,
        )
    else:
        ray.init(address=address, logging_level=logging.WARNING)
    try:
        counts = {role: n for role, n in d.topology.counts().items() if n}
        autoscaler = PoolAutoscaler(floor=counts) if d.planner.autobalance else None
        pools = RayPools(spec, secret, autoscaler)
        endpoints = pools.start(counts)
        plan.log.info("%d worker actors ready on Ray", len(endpoints))
        return asyncio.run(http.serve_router(d, endpoints, cost, pools=pools))
    finally:
        ray.shutdown()
