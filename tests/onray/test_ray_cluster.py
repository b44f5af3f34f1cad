"""pdserve on a multi-node Ray cluster on one machine (ray.cluster_utils.Cluster): a head with no
CPUs, a node with `pdserve_prefill`, a node with `pdserve_decode`. P and D land on their nodes,
bind the node's (non-loopback) address with HMAC-tagged control messages, and answer exactly as a
LocalCluster does; scaling D 1 -> 2 -> 1 under load (by the admin call, then by --autobalance's
policy) and losing the D node mid-stream lose no request, and the lost node's worker comes back
on a new node.

Ray starts once for the module (include_dashboard=False, 100 MB object stores, small KV caches)
and one RayCluster serves the tests in order (starting workers is most of their cost); the last
test changes the cluster (it removes the D node).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from factories import assert_cluster_idle, eventually
from pdserve.cluster import LocalCluster
from pdserve.costmodel.model import CostModel
from pdserve.engine.request import SamplingParams
from pdserve.ray.cluster import RayCluster
from pdserve.ray.pools import PoolSpec
from pdserve.ray.scaling import PoolAutoscaler
from pdserve.router.slo import SloPlanner
from pdserve.workers import auth
from pdserve.workers import messages as m

SECRET = b"ray-test-secret-0123456789abcdef"
STORE = 100 << 20
PROMPTS = [f"Tell me about the number {i}." for i in range(6)]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# A dead node is noticed in ~3 s, not Ray's default ~30 s (GCS health checks).
FAST_FAILURE = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
}


# Three raylets, their agents and the workers share two busy cores here: a heartbeat may lag.
LIVENESS = {"liveness_timeout_s": 6.0}
# Small KV caches (the default 1 GB each would be most of the memory budget).
ENGINE = {"kv_cache_memory_gb": 0.05}


def decode_node(cluster: Cluster) -> Any:
    """Room for four D workers: the module's cluster scales to two, the autobalance test's
    own cluster (beside it) to two more."""
    return cluster.add_node(num_cpus=4, resources={"pdserve_decode": 4}, object_store_memory=STORE)


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Any]]:
    # Ray's memory monitor kills actors when the *machine* is nearly full, whoever fills it; on
    # a shared test machine that is other jobs. Ray's processes read this at start-up.
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # noqa: SIM112 (Ray's spelling)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "object_store_memory": STORE,
            "_system_config": FAST_FAILURE,
        },
    )
    try:
        found = {
            "cluster": cluster,
            "prefill": cluster.add_node(
                num_cpus=2, resources={"pdserve_prefill": 2}, object_store_memory=STORE
            ),
            "decode": decode_node(cluster),
        }
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        cluster.wait_for_nodes()
        yield found
    finally:
        ray.shutdown()
        cluster.shutdown()
        m.set_key(None)
        os.environ.pop("RAY_memory_monitor_refresh_ms", None)


@pytest.fixture(scope="module")
def reference(tiny_llama_path: Any) -> list[list[int]]:
    """Greedy tokens of the prompts on a LocalCluster (1P + 1D worker processes)."""
    with LocalCluster(str(tiny_llama_path), 1, 1, threads=1, engine_args=ENGINE) as local:
        return [o.outputs[0].token_ids for o in local.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def shared(
    nodes: dict[str, Any], tiny_llama_path: Any, reference: list[list[int]]
) -> Iterator[RayCluster]:
    """One RayCluster for the module's tests (starting workers is most of their time). After
    the reference: a LocalCluster sets this process's message key from the environment."""
    spec = PoolSpec(engine_args={"model": str(tiny_llama_path), **ENGINE}, drain_timeout_s=60.0)
    with RayCluster(str(tiny_llama_path), spec=spec, secret=SECRET, core_args=LIVENESS) as c:
        yield c


@pytest.fixture
def on_ray(shared: RayCluster) -> Iterator[RayCluster]:
    yield shared
    assert_cluster_idle(shared)  # every worker up holds no KV, request or transfer


def rows(c: RayCluster) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in c.table()}


def healthy(c: RayCluster, role: str) -> list[str]:
    return sorted(i for i, r in rows(c).items() if r["healthy"] and r["role"] == role)


def assert_all_served(outs: list[Any], reference: list[list[int]] | None = None) -> None:
    assert [o.error for o in outs] == [None] * len(outs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    if reference is not None:
        assert [o.outputs[0].token_ids for o in outs] == reference


def test_p_and_d_on_their_nodes_answer_as_a_local_cluster(
    on_ray: RayCluster, nodes: dict[str, Any], reference: list[list[int]]
) -> None:
    eventually(lambda: healthy(on_ray, "prefill") + healthy(on_ray, "decode") == ["P0", "D0"])
    table = rows(on_ray)
    assert table["P0"]["ray_node"] == nodes["prefill"].node_id[:12]
    assert table["D0"]["ray_node"] == nodes["decode"].node_id[:12]
    # bound to the node's address, not loopback: the secret is required and used
    assert not auth.is_loopback(table["P0"]["url"]) and not auth.is_loopback(table["D0"]["url"])
    outs = on_ray.generate(PROMPTS, GREEDY)
    assert_all_served(outs, reference)
    assert on_ray.stats["kv_recv_bytes"] > 0  # the requests went P -> D over ZeroMQ
    assert on_ray.stats["local_fallbacks"] == 0


def test_the_secret_is_in_no_command_line_environment_or_ray_log(
    on_ray: RayCluster, nodes: dict[str, Any]
) -> None:
    assert_all_served(on_ray.generate(PROMPTS[:2], GREEDY))  # tagged messages flowed
    for row in on_ray.table():
        for part in ("cmdline", "environ"):
            assert SECRET not in Path(f"/proc/{row['pid']}/{part}").read_bytes(), (row, part)
    session = Path(nodes["cluster"].head_node.get_session_dir_path())
    logs = [f for f in session.rglob("*") if f.is_file() and f.stat().st_size < 64 << 20]
    assert any(f.suffix in (".log", ".out", ".err") for f in logs)
    assert [f for f in logs if SECRET in f.read_bytes()] == []


def test_scaling_decode_one_to_two_and_back_under_load_loses_none(
    on_ray: RayCluster, nodes: dict[str, Any]
) -> None:
    load = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    _, first = on_ray.submit(PROMPTS * 2, load)
    status = on_ray.resize({"decode": 2})
    assert status["pools"]["decode"]["target"] == 2
    eventually(lambda: healthy(on_ray, "decode") == ["D0", "D1"], 120, "D1 joins")
    assert rows(on_ray)["D1"]["ray_node"] == nodes["decode"].node_id[:12]
    assert rows(on_ray)["D1"]["origin"] == "admin"
    _, second = on_ray.submit(PROMPTS * 2, load)
    eventually(lambda: on_ray.worker_stats().get("D1", {}).get("running", 0), 60, "D1 serving")
    on_ray.resize({"decode": 1})  # drains one of them while requests run
    eventually(lambda: len(healthy(on_ray, "decode")) == 1, 120, "one D drained")
    assert_all_served(first.result(300) + second.result(300))
    eventually(lambda: on_ray.pools is not None and len(on_ray.pools.members) == 2, 60, "stop")
    counters = on_ray.stats
    assert counters["pool_added_decode"] == 1 and counters["pool_drained_decode"] == 1
    assert counters["requests_error"] == 0


def test_autobalance_grows_a_saturated_decode_pool_and_shrinks_it_back(
    nodes: dict[str, Any], tiny_llama_path: Any
) -> None:
    # a cost model whose decode step grows 0.2 s per request: a dozen decodes saturate one D
    model = CostModel((0.0, 1e-4, 0.0), (0.005, 0.2, 0.0), (0.0, 1e12))
    planner = SloPlanner(model, slo_tpot_s=0.5, admission=False, mode="always")
    # the ceiling: D0 stays saturated after D1 joins (its requests stay on it), which would
    # grow a third D while the node has room
    policy = PoolAutoscaler(
        floor={"prefill": 1, "decode": 1}, ceiling={"decode": 2}, sustain_s=1, cooldown_s=2
    )
    spec = PoolSpec(engine_args={"model": str(tiny_llama_path), **ENGINE})
    with RayCluster(
        str(tiny_llama_path),
        spec=spec,
        secret=SECRET,
        autoscaler=policy,
        core_args={"planner": planner, **LIVENESS},
    ) as c:
        c.set_fault("D0", "slow", count=-1, delay_s=0.05)  # so the load lasts a while
        load = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        _, job = c.submit(PROMPTS * 2, load)
        eventually(lambda: c.stats["autoscale_grow_decode"] == 1, 60, "the decode pool grows")
        eventually(lambda: healthy(c, "decode") == ["D0", "D1"], 120, "D1 joins")
        assert rows(c)["D1"]["origin"] == "autobalance"
        assert_all_served(job.result(300))
        c.set_fault("D0", "none")
        eventually(lambda: c.stats["autoscale_shrink_decode"] == 1, 60, "the idle pool shrinks")
        eventually(lambda: len(healthy(c, "decode")) == 1, 60, "back to one D")
        assert c.stats["pool_added_decode"] == 1 and c.stats["pool_drained_decode"] == 1
        assert_cluster_idle(c)


def test_losing_the_decode_node_mid_stream_loses_no_request(
    on_ray: RayCluster, nodes: dict[str, Any], reference: list[list[int]]
) -> None:
    cluster = nodes["cluster"]
    (d,) = healthy(on_ray, "decode")  # D0 or D1, whichever the scaling test kept
    rids, job = on_ray.submit(PROMPTS, GREEDY)
    eventually(lambda: any(on_ray.pair_of(r) == ("P0", d) for r in rids), 60, f"requests on {d}")
    cluster.remove_node(nodes["decode"])  # the machine dies: raylet, the actor, all of it
    outs = job.result(300)
    assert_all_served(outs, reference)  # recovered (run whole on P0 while no D is left)
    assert on_ray.stats["recoveries"] >= 1
    # a new machine with the decode resource: Ray restarts the actor there, and it rejoins
    nodes["decode"] = decode_node(cluster)
    eventually(lambda: healthy(on_ray, "decode") == [d], 180, f"{d} back on a new node")
    row = rows(on_ray)[d]
    assert row["ray_node"] == nodes["decode"].node_id[:12] and row["ray_restarts"] == 1
    assert_all_served(on_ray.generate(PROMPTS, GREEDY), reference)
    assert on_ray.stats["ray_restarts"] == 1
    assert on_ray.stats["requests_error"] == 0
