"""`pdserve serve --ray [auto|ADDRESS]`: the router here, every worker a Ray actor.

1. Connect to Ray: `auto` starts a local instance (dashboard off unless --ray-dashboard, a small
   object store: pdserve sends nothing through it); an address joins a running cluster.
2. Start the workers as actors (pools.py) and wait for their endpoints.
3. Serve the router (serve.py's `_serve_router`, the same as without Ray) with the pools
   attached: Ray restarts dead actors, the pools rejoin them, /admin/pools resizes.
The shared secret goes to the actors as a constructor argument, never through a command line
or the environment of Ray's processes; it is required unless every worker binds loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
from collections import Counter

from pdserve import serve
from pdserve.ray.placement import ray_address
from pdserve.ray.pools import PoolSpec, RayPools
from pdserve.ray.scaling import PoolAutoscaler
from pdserve.workers import auth
from pdserve.workers import messages as m

OBJECT_STORE_BYTES = 200 << 20


def pool_spec(args: argparse.Namespace, local: bool) -> tuple[PoolSpec, dict[str, int]]:
    """The actors' engine arguments and worker config (from the flags `pdserve serve` has
    anyway), and how many workers of each role to start."""
    specs = serve._worker_specs(args)
    counts = dict(Counter(s.role for s in specs))
    cpus = args.ray_cpus_per_worker
    if cpus is None:
        cpus = max(1, (os.cpu_count() or 1) // len(specs)) if local else 1
    if cpus <= 0:
        raise ValueError("--ray-cpus-per-worker must be > 0")
    engine = dict(specs[0].engine_args)
    engine["threads"] = args.threads  # None: the actor's CPUs (placement.threads_for)
    roles = {s.role: s.config for s in specs}
    spec = PoolSpec(
        engine_args=engine,
        worker_config=specs[0].config,
        role_configs=roles,
        cpus_per_worker=cpus,
        max_restarts=args.ray_max_restarts,
        loopback=local,
    )
    return spec, counts


def run(args: argparse.Namespace) -> int:
    import ray

    serve._setup_logging()
    address = ray_address(args.ray)
    local = address is None
    spec, counts = pool_spec(args, local)
    secret = auth.load_secret(args.secret_file)
    # off this machine the workers bind their node's address: authenticated or not at all
    auth.require_secret(["127.0.0.1" if local else "ray-cluster-nodes"], secret)
    m.set_key(secret)
    threads = int(args.threads or spec.cpus_per_worker)
    cost = serve._cost_model(args, args.model, threads)
    decode_cfgs = serve._with_stall_free(args, serve._worker_specs(args), cost, threads)
    spec = dataclasses.replace(spec, role_configs={s.role: s.config for s in decode_cfgs})
    if local:
        ray.init(
            include_dashboard=args.ray_dashboard,
            object_store_memory=OBJECT_STORE_BYTES,
            logging_level=logging.WARNING,
        )
    else:
        ray.init(address=address, logging_level=logging.WARNING)
    try:
        autoscaler = PoolAutoscaler(floor=counts) if args.autobalance else None
        pools = RayPools(spec, secret, autoscaler)
        endpoints = pools.start(counts)
        serve.log.info("%d worker actors ready on Ray", len(endpoints))
        return asyncio.run(
            serve._serve_router(endpoints, args, args.model, cost_model=cost, pools=pools)
        )
    finally:
        ray.shutdown()
