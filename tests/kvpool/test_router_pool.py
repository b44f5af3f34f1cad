"""The router's side of the KV pool (pure): the pool index, and the SLO planner weighing a pool
load against the prefill it saves."""

from __future__ import annotations

import pytest

from pdserve.config import WorkerConfig, config_argv
from pdserve.costmodel.model import CostModel
from pdserve.engine.block_pool import hash_full_blocks
from pdserve.router.pool_index import PoolIndex
from pdserve.router.slo import Route, SloPlanner, WorkerLoad

MODEL = CostModel((0.01, 1e-3, 1e-4), (0.02, 0.002, 0.001), (0.001, 1e9))
PROMPT = list(range(1000, 1100))  # 6 full blocks of 16


def test_pool_index_matches_per_pool_and_workers_take_their_best_pool() -> None:
    idx = PoolIndex()
    hashes = hash_full_blocks(PROMPT, 16)
    idx.add(["redis"], 16, hashes[:4])
    idx.add(["mem-P0"], 16, hashes[:2])
    got = idx.match(PROMPT, {"P0": ["mem-P0", "redis"], "P1": ["mem-P1"], "D0": ["redis"]})
    assert got == {"P0": 64, "P1": 0, "D0": 64}
    idx.add(["redis"], 16, hashes[5:6])  # a gap: only the leading run counts
    assert idx.match(PROMPT, {"D0": ["redis"]}) == {"D0": 64}


def test_pool_index_is_bounded() -> None:
    idx = PoolIndex(max_hashes=3)
    hashes = hash_full_blocks(PROMPT, 16)
    idx.add(["redis"], 16, hashes)
    assert idx.stats() == {"redis": 3}
    assert idx.match(PROMPT, {"D0": ["redis"]}) == {"D0": 0}  # the oldest (leading) went


def test_planner_loads_from_the_pool_when_cheaper_than_computing() -> None:
    p = SloPlanner(MODEL, kv_bytes_per_token=1000, pool_bytes_per_s=1e9)
    ls = {"P0": WorkerLoad("P0"), "P1": WorkerLoad("P1"), "D0": WorkerLoad("D0")}
    routes = [Route("remote", "P0", "D0"), Route("remote", "P1", "D0")]
    plain = p.predict(2000, 50, routes[0], ls, {}, now=0.0)
    pooled = p.predict(2000, 50, routes[0], ls, {}, now=0.0, pooled={"P0": 1500})
    assert pooled.pooled_first == 1500
    load = 1500 * 1000 / 1e9
    want = MODEL.prefill_s(500, 1500) + load
    assert pooled.ttft_s == pytest.approx(want)
    assert pooled.ttft_s < plain.ttft_s
    # with the same load elsewhere, the worker that can load the prefix wins
    d = p.decide(2000, 50, routes, ls, {}, now=0.0, pooled={"P1": 1500})
    assert d.chosen is not None and d.chosen.route.first == "P1"


def test_planner_ignores_a_pool_slower_than_recomputing() -> None:
    p = SloPlanner(MODEL, kv_bytes_per_token=1e6, pool_bytes_per_s=1e6)  # 1 s per token
    ls = {"P0": WorkerLoad("P0"), "D0": WorkerLoad("D0")}
    pred = p.predict(200, 10, Route("remote", "P0", "D0"), ls, {}, 0.0, pooled={"P0": 160})
    assert pred.pooled_first == 0
    assert pred.ttft_s == pytest.approx(MODEL.prefill_s(200))


def test_kv_pool_flags_round_trip_and_bad_values_are_refused() -> None:
    import argparse

    from pdserve.config import add_config_args, config_from_args

    cfg = WorkerConfig(kv_pool_memory_gb=2.5, kv_pool_disk="/tmp/x", kv_pool_redis="redis://h:1/2")
    parser = argparse.ArgumentParser()
    add_config_args(parser, WorkerConfig)
    assert config_from_args(WorkerConfig, parser.parse_args(config_argv(cfg))) == cfg
    assert "--kv-pool-redis" not in config_argv(WorkerConfig())  # off: nothing to pass on
    with pytest.raises(ValueError, match="redis://"):
        WorkerConfig(kv_pool_redis="localhost:6379")
    with pytest.raises(ValueError, match="kv_pool_memory_gb"):
        WorkerConfig(kv_pool_memory_gb=-1)


def test_router_metrics_export_each_workers_pool_tiers() -> None:
    from types import SimpleNamespace

    from pdserve.metrics.prometheus import Metrics

    m = Metrics()
    assert b"pdserve_kvpool_hit_blocks" not in m.render()  # no pool: nothing
    tiers = {"redis": {"hit_blocks": 6, "lookup_blocks": 8, "bytes": 4096}}
    stats = {"prefill_tokens": 10, "kv_pool": {"tiers": tiers}}
    m.on_worker_stats(SimpleNamespace(worker_id="P0", role="prefill"), stats)
    text = m.render().decode()
    assert 'pdserve_kvpool_hit_blocks_total{role="prefill",tier="redis",worker="P0"} 6.0' in text
    assert 'pdserve_kvpool_lookup_blocks_total{role="prefill",tier="redis",worker="P0"} 8.0' in text
    assert 'pdserve_kvpool_used_bytes{role="prefill",tier="redis",worker="P0"} 4096.0' in text
