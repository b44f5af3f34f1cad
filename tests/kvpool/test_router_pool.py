"""The router's side of the KV pool (pure): the pool index, and the SLO planner weighing a pool
load against the prefill it saves."""

from __future__ import annotations

from typing import Any

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


# ---- the router's feedback from the workers' pool reports (router/pool_feedback.py) --------


def _worker(wid: str, role: str, pools: list[str], outstanding: int = 0) -> Any:
    from pdserve.router.flight import WorkerState
    from pdserve.workers.messages import WorkerInfo

    info = WorkerInfo(wid, role, 1, "", 16, 64, b"", "m", kv_pools=pools)
    return WorkerState(f"inproc://{wid}", None, info, healthy=True, outstanding=outstanding)  # type: ignore[arg-type]


def _flight(prompt: list[int], pair: tuple[Any, Any], sent: list[int] | None = None) -> Any:
    import asyncio

    from pdserve import SamplingParams
    from pdserve.router.flight import Flight

    f = Flight("r1", list(prompt), SamplingParams(max_tokens=8), asyncio.Queue(), pair=pair)
    f.sent = list(sent or [])
    return f


def _feedback(planner: SloPlanner | None = None) -> Any:
    from pdserve.router.events import RouterEvents
    from pdserve.router.pool_feedback import PoolFeedback

    return PoolFeedback(PoolIndex(), RouterEvents(), planner)


def test_a_lookup_finding_less_than_the_index_predicted_corrects_the_index() -> None:
    fb = _feedback()
    p0, d0 = _worker("P0", "prefill", ["redis"]), _worker("D0", "decode", [])
    hashes = hash_full_blocks(PROMPT, 16)
    fb.index.add(["redis"], 16, hashes[:4])
    flight = _flight(PROMPT, (p0, d0))
    fb.expect(flight, PROMPT)
    assert flight.pool_expected == ("P0", 64, len(PROMPT))  # the index says 4 blocks
    fb.on_report(flight, "P0", {"hit_tokens": 32, "loaded_tokens": 32, "load_s": 0.01}, 0.0)
    assert fb.index.match(PROMPT, {"P0": ["redis"]}) == {"P0": 32}  # now 2, like the pool
    assert fb.stats()["index_corrections"] == 1
    assert fb.events.counters["pool_index_corrections"] == 1
    # a report that matches the prediction (or is another worker's) changes nothing
    fb.expect(flight, PROMPT)
    fb.on_report(flight, "P0", {"hit_tokens": 16, "local_tokens": 16}, 0.0)
    fb.expect(flight, PROMPT)
    fb.on_report(flight, "D0", {"hit_tokens": 0}, 0.0)
    assert fb.index.match(PROMPT, {"P0": ["redis"]}) == {"P0": 32}
    assert fb.corrections == 1


def test_the_index_never_predicts_the_block_holding_the_last_token() -> None:
    fb = _feedback()
    p0 = _worker("P0", "prefill", ["redis"])
    prompt = PROMPT[:64]  # 4 full blocks: the engine computes the last token's block itself
    fb.index.add(["redis"], 16, hash_full_blocks(prompt, 16))
    flight = _flight(prompt, (p0, None))
    fb.expect(flight, prompt)
    assert flight.pool_expected == ("P0", 48, 64)
    fb.on_report(flight, "P0", {"hit_tokens": 48, "loaded_tokens": 48}, 0.0)
    assert fb.corrections == 0


def test_pool_bandwidth_learns_per_worker_from_the_prior() -> None:
    from pdserve.router.pool_index import PoolBandwidth

    bw = PoolBandwidth(prior=1e9)
    assert bw.rate("P0") == 1e9
    assert not bw.observe("P0", 160, 0.1, 0.0)  # KV bytes per token unknown: ignored
    assert bw.observe("P0", 160, 0.1, 1e5)  # 1.6e8 B/s: half-way from the prior (in logs)
    assert bw.rate("P0") == pytest.approx((1e9 * 1.6e8) ** 0.5)
    for _ in range(40):
        bw.observe("P0", 160, 0.1, 1e5)
    assert bw.rate("P0") == pytest.approx(1.6e8, rel=0.01)
    assert bw.rate("P1") == 1e9  # per worker
    assert bw.stats()["workers"]["P0"]["loads"] == 41
    with pytest.raises(ValueError, match="prior"):
        PoolBandwidth(prior=0)


def test_the_planner_stops_loading_from_a_pool_measured_slower_than_recomputing() -> None:
    p = SloPlanner(MODEL, kv_bytes_per_token=1000, pool_bytes_per_s=1e9)
    fb = _feedback(p)
    ls = {"P0": WorkerLoad("P0"), "P1": WorkerLoad("P1"), "D0": WorkerLoad("D0")}
    routes = [Route("remote", "P0", "D0"), Route("remote", "P1", "D0")]
    pooled = {"P0": 1500, "P1": 1000}
    d = p.decide(2000, 50, routes, ls, {}, now=0.0, pooled=pooled)
    assert d.chosen is not None and d.chosen.route.first == "P0" and d.chosen.pooled_first == 1500
    # P0's loads turn out slow: 1500 tokens (1.5 MB) in 30 s, slower than computing them
    p0, d0 = _worker("P0", "prefill", ["disk"]), _worker("D0", "decode", [])
    for _ in range(20):
        report = {"hit_tokens": 1500, "loaded_tokens": 1500, "load_s": 30.0}
        fb.on_report(_flight(PROMPT, (p0, d0)), "P0", report, 0.0)
    assert p.pool_bandwidth.rate("P0") == pytest.approx(5e4, rel=0.1)
    slow = p.predict(2000, 50, routes[0], ls, {}, 0.0, pooled=pooled)
    assert slow.pooled_first == 0  # recomputing beats that pool now
    d = p.decide(2000, 50, routes, ls, {}, now=0.0, pooled=pooled)
    assert d.chosen is not None and d.chosen.route.first == "P1" and d.chosen.pooled_first == 1000
    assert fb.stats()["bandwidth"]["workers"]["P0"]["loads"] == 20


def test_a_dead_ds_request_resumes_on_the_d_whose_pool_holds_its_context() -> None:
    fb = _feedback()
    context = PROMPT  # 60 prompt tokens + 40 streamed
    fb.index.add(["redis"], 16, hash_full_blocks(context, 16)[:5])  # 80 of 100 tokens
    p0 = _worker("P0", "prefill", ["redis"])
    dead, d1 = _worker("D0", "decode", ["redis"]), _worker("D1", "decode", ["redis"], 1)
    d2 = _worker("D2", "decode", ["mem-D2"])  # a pool without this context
    flight = _flight(PROMPT[:60], (p0, dead), sent=PROMPT[60:])
    assert fb.recovery_target(flight, dead, [p0, dead, d1, d2]) is d1
    assert fb.recovery_target(flight, p0, [p0, dead, d1, d2]) is None  # a P died: the usual
    d1.healthy = False
    assert fb.recovery_target(flight, dead, [p0, dead, d1, d2]) is None  # D2's pool: too little
    assert fb.events.counters["recovery_pool_too_little"] == 1
    no_pool = _worker("D3", "decode", [])
    assert fb.recovery_target(flight, dead, [p0, dead, no_pool]) is None  # no pool: via P


def test_serve_flag_sets_the_planners_pool_bandwidth_prior() -> None:
    from pdserve.cli import build_parser
    from pdserve.serve import flags, plan

    def planner(*argv: str):  # type: ignore[no-untyped-def]
        return plan.planner(flags.deployment(build_parser().parse_args(["serve", *argv])), MODEL)

    got = planner("--kv-pool-gbps", "0.5")
    assert got is not None and got.pool_bandwidth.rate("P0") == 0.5e9
    with pytest.raises(ValueError, match="prior must be > 0"):
        planner("--kv-pool-gbps", "0")
