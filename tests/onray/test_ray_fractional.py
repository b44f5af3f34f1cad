"""Half a CPU per worker on a local Ray of one CPU: P and D start, each with one torch thread, and
serve; a third worker (POST /admin/pools {"decode": 2}) cannot be placed and says why."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from factories import eventually
from pdserve.deployment import Deployment, PlannerConfig, RayConfig
from pdserve.engine.request import SamplingParams
from pdserve.ray.cluster import RayCluster
from pdserve.ray.pools import PoolSpec
from pdserve.workers import messages as m


@pytest.fixture
def one_cpu() -> Iterator[None]:
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # noqa: SIM112 (see test_ray_cluster.py)
    ray.init(
        address="local",  # a Ray of its own, whatever /tmp/ray says runs on this machine
        num_cpus=1,
        include_dashboard=False,
        object_store_memory=100 << 20,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()
        m.set_key(None)
        os.environ.pop("RAY_memory_monitor_refresh_ms", None)


def test_half_a_cpu_each_starts_two_workers_and_a_third_says_why(
    one_cpu: None, tiny_llama_path: Any
) -> None:
    d = Deployment(
        model=str(tiny_llama_path),
        engine={"kv_cache_memory_gb": 0.05},
        planner=PlannerConfig(cost_model="none"),
        ray=RayConfig(cpus_per_worker=0.5),
    )
    spec = PoolSpec.of(d, loopback=True)
    with RayCluster(deployment=d, spec=spec, core_args={"liveness_timeout_s": 6.0}) as c:
        assert c.pools is not None
        assert sorted(mem.info["threads"] for mem in c.pools.members) == [1, 1]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        assert [o.error for o in c.generate(["Hello there"], params)] == [None]
        status = c.resize({"decode": 2})
        assert status["pools"]["decode"]["target"] == 2
        pools = c.pools
        eventually(lambda: pools.status()["pending"], 30, "D1 reported pending", interval_s=0.5)
        assert pools.status()["pending"] == [
            {"worker": "D1", "role": "decode", "reason": "pending: needs CPU 0.5, 0 free"}
        ]
        assert pools.status()["pools"]["decode"]["pending"] == 1
        c.resize({"decode": 1})  # the unplaced one goes first, at once
        eventually(lambda: [mem.worker_id for mem in pools.members] == ["P0", "D0"], 30)
