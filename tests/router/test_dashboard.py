"""The dashboard's JSON (validated against its schema) over the scripted fake core, its key
check, the page's self-containment, and the pure parts: the window point, waterfall spans, states,
worker events, the KV-pool panel's presence rule."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fake_core import FakeCore
from fastapi.testclient import TestClient
from prometheus_client import Gauge
from prometheus_client.parser import text_string_to_metric_families

from pdserve.metrics import Metrics
from pdserve.metrics.prometheus import Finished
from pdserve.router import dashboard as d
from pdserve.router import dashboard_data as data
from pdserve.router.app import create_app

MODEL = "fake-model"
KEY = "sk-dash"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def core() -> FakeCore:
    return FakeCore()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(slo_ttft_s=10.0, slo_tpot_s=10.0)


@pytest.fixture
def client(core: FakeCore, metrics: Metrics, default_tokenizer: Any) -> TestClient:
    app = create_app(core, default_tokenizer, model_name=MODEL, api_key=KEY, metrics=metrics)
    return TestClient(app, raise_server_exceptions=False)


def complete(client: TestClient, n: int = 3) -> list[str]:
    rids = []
    for _ in range(n):
        r = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Hello world", "max_tokens": 3},
            headers=AUTH,
        )
        assert r.status_code == 200, r.text
        rids.append(r.json()["id"])
    return rids


def metric_values(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# ---- the endpoint ----------------------------------------------------------------------------
def test_snapshot_matches_schema_and_metrics(
    client: TestClient, core: FakeCore, metrics: Metrics
) -> None:
    core.worker_stats["D0"] = {"batch_requests": 2, "prefix_cache_hit_rate": 0.25}
    core.emit_worker_stats()
    rids = complete(client, 3)
    bad = client.post("/v1/completions", json={"model": MODEL, "prompt": ""}, headers=AUTH)
    assert bad.status_code == 400
    r = client.get(d.JSON_PATH, headers=AUTH)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    snap = d.Snapshot.model_validate(r.json())
    assert [w.id for w in snap.workers] == ["P0", "D0"]
    p0, d0 = snap.workers
    assert (p0.role, p0.state, d0.batch, d0.prefix_hit_rate) == ("prefill", "ready", 2, 0.25)
    assert d0.heartbeat_age_s == 0.1
    # the waterfall: newest first, every request with its spans
    assert [q.id for q in snap.requests] == rids[::-1]
    assert all(q.outcome == "ok" and q.output_tokens == 3 for q in snap.requests)
    assert {s.stage for s in snap.requests[0].segments} == {"queue", "decode"}
    # the numbers are the ones /metrics exposes
    mv = metric_values(client.get("/metrics").text)
    assert snap.totals.requests["ok"] == mv[("pdserve_requests_total", (("outcome", "ok"),))] == 3
    code = (("code", "empty_prompt"),)
    assert snap.totals.rejections["empty_prompt"] == mv[("pdserve_request_rejections_total", code)]
    assert snap.totals.generation_tokens == 9
    assert snap.now.n == 3 and snap.now.ttft_p50 is not None
    assert snap.now.goodput_rps == pytest.approx(3 / data.WINDOW_S, abs=1e-4)
    assert snap.series and snap.kv_pool is None
    assert mv[("pdserve_requests_within_slo_total", ())] == 3  # the same goodput definition
    assert snap.slo == {"ttft_s": 10.0, "tpot_s": 10.0}


def test_key_guards_the_data_not_the_page(client: TestClient) -> None:
    assert client.get(d.JSON_PATH).status_code == 401
    wrong = client.get(d.JSON_PATH, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    page = client.get(d.PAGE_PATH)  # static code, no data: a browser cannot send the header
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert d.JSON_PATH in page.text


def test_page_is_self_contained() -> None:
    html = d.page().decode()
    # nothing fetched from elsewhere: no src/href/url() to another origin, no imports
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", html)
    assert "<script src" not in html and "@import" not in html
    assert "innerHTML" not in html  # server data is only ever set as text


def test_snapshots_are_shared_between_polls(core: FakeCore, metrics: Metrics) -> None:
    board = d.Dashboard(core, metrics)
    first = board.snapshot_bytes(now=100.0)
    assert board.snapshot_bytes(now=100.0 + d.CACHE_S / 2) is first
    assert board.snapshot_bytes(now=100.0 + d.CACHE_S) is not first


# ---- worker states and events ----------------------------------------------------------------
def test_worker_states() -> None:
    row = {"id": "w", "role": "decode", "healthy": True, "kv_blocks_used": 3, "kv_blocks_total": 4}
    assert data.worker_row(row, {"heartbeat_age_s": 0.2})["state"] == "ready"
    assert data.worker_row(row, {"heartbeat_age_s": 1.6})["state"] == "degraded"
    assert data.worker_row({**row, "draining": True}, {})["state"] == "draining"
    down = data.worker_row({**row, "healthy": False, "down_reason": "stuck"}, {})
    assert down["state"] == "down" and down["down_reason"] == "stuck"
    assert data.worker_row(row, {})["kv_use"] == 0.75


def test_role_switch_restart_and_outage_are_events(core: FakeCore, metrics: Metrics) -> None:
    board = d.Dashboard(core, metrics)
    board.sample(now=10.0)
    assert not board.events
    core.rows[0]["role"] = "decode"
    core.counters["role_switches_autobalance"] += 1
    core.rows[1]["pid"] = 4242
    board.sample(now=10.1)  # within WATCH_S: no look
    assert not board.events
    board.sample(now=11.0)
    kinds = {(e["worker"], e["kind"]): e["detail"] for e in board.events}
    assert kinds[("P0", "role_switch")] == "prefill -> decode by autobalance"
    assert kinds[("D0", "restart")] == "pid 1001 -> 4242"
    core.rows[1]["healthy"] = False
    core.rows[1]["down_reason"] = "no_heartbeat"
    board.sample(now=12.0)
    core.rows[1]["healthy"] = True
    board.sample(now=13.0)
    assert [(e["kind"], e["detail"]) for e in list(board.events)[-2:]] == [
        ("down", "no_heartbeat"),
        ("up", "back in routing"),
    ]
    snap = d.Snapshot.model_validate(board.snapshot(now=14.0))
    assert len(snap.events) == 4 and len(snap.series) == 5


def test_a_change_undone_between_two_looks_still_shows(core: FakeCore, metrics: Metrics) -> None:
    board = d.Dashboard(core, metrics)
    board.sample(now=1.0)
    core.counters["role_switches_admin"] += 2  # there and back: the table looks the same
    core.counters["workers_down"] += 1
    core.counters["workers_up"] += 1
    board.sample(now=2.0)
    assert [(e["worker"], e["kind"], e["detail"].split()[0]) for e in board.events] == [
        ("?", "role_switch", "2"),
        ("?", "down", "1"),
        ("?", "up", "1"),
    ]
    board.sample(now=3.0)  # counted once
    assert len(board.events) == 3


# ---- pure parts ----------------------------------------------------------------------------------
def test_window_point_counts_goodput_within_both_slos() -> None:
    mx = Metrics(slo_ttft_s=0.3, slo_tpot_s=0.02)

    def f(end: float, ttft: float, tpot: float | None, outcome: str = "ok") -> Finished:
        good = outcome == "ok" and mx.meets_slo(ttft, tpot)
        return Finished("r", end, outcome, "remote", 10, 5, ttft, tpot, good)

    recent = [
        f(1.0, 0.1, 0.01),  # outside the window
        f(50.0, 0.1, 0.01),  # good
        f(60.0, 0.5, 0.01),  # misses TTFT
        f(61.0, 0.1, 0.05),  # misses TPOT
        f(62.0, 0.2, None, "aborted"),
        f(63.0, 0.1, 0.01),  # after `now`
    ]
    p = data.window_point(recent, 62.0, 1000.0)
    assert p["n"] == 4 and p["throughput_rps"] == round(3 / 60, 4)
    assert p["goodput_rps"] == round(1 / 60, 4)
    assert p["ttft_p50"] == pytest.approx(0.15) and p["tpot_p90"] == pytest.approx(0.042)


def test_segments_of_a_disaggregated_request() -> None:
    events = [
        ("arrive", "router", 0.0),
        ("dispatch", "attempt 1", 0.2),
        ("queue", "P0", 1.0),
        ("prefill_start", "P0", 3.0),
        ("transfer_start", "P0", 3.5),
        ("prefill_end", "P0", 9.0),
        ("first_token", "P0", 9.5),
        ("transfer_end", "D0", 10.0),
        ("decode_first_token", "D0", 14.0),
        ("finish", "router", 40.0),
    ]
    spans = data.segments([{"event": e, "worker": w, "t_ms": t} for e, w, t in events])
    assert [(s["stage"], s["worker"], s["start_ms"], s["end_ms"]) for s in spans] == [
        ("queue", "P0", 0.0, 3.0),
        ("prefill", "P0", 3.0, 9.0),
        ("transfer", "D0", 3.5, 10.0),
        ("decode", "D0", 10.0, 40.0),
    ]
    assert data.segments([]) == []


def test_kv_pool_panel_only_with_its_metrics(core: FakeCore, metrics: Metrics) -> None:
    board = d.Dashboard(core, metrics)
    assert board.snapshot(now=1.0)["kv_pool"] is None
    hit = Gauge("pdserve_kvpool_hit_rate", "h", ["tier"], registry=metrics.registry)
    size = Gauge("pdserve_kvpool_used_bytes", "b", ["tier"], registry=metrics.registry)
    hit.labels("memory").set(0.4)
    size.labels("memory").set(2048)
    size.labels("disk").set(1 << 20)
    pool = d.Snapshot.model_validate(board.snapshot(now=2.0)).kv_pool
    assert pool is not None
    assert [(t.tier, t.hit_rate, t.bytes) for t in pool] == [
        ("memory", 0.4, 2048.0),
        ("disk", None, float(1 << 20)),
    ]


def test_kv_pool_panel_reads_a_real_pools_metrics(
    core: FakeCore, metrics: Metrics, tmp_path: Path
) -> None:
    import time

    import torch

    from pdserve.kvpool import PoolNamespace, TieredKVPool
    from pdserve.kvpool.disk import DiskTier
    from pdserve.kvpool.tiers import MemoryTier

    ns = PoolNamespace("m", "float32", "00", block_size=4)
    tiers = [MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20)]
    pool = TieredKVPool(ns, tiers, registry=metrics.registry)
    try:
        pool.put(0, [b"a" * 32], [torch.ones(1, 2, 4, 1, 2)])
        assert pool.flush()
        assert pool.lookup([b"a" * 32, b"b" * 32]) == 1
        assert len(pool.get([b"a" * 32], time.monotonic() + 10)) == 1
        board = d.Dashboard(core, metrics)
        rows = d.Snapshot.model_validate(board.snapshot(now=1.0)).kv_pool
        assert rows is not None
        by_tier = {t.tier: t for t in rows}
        assert by_tier["memory"].hit_rate == 0.5 and by_tier["disk"].hit_rate == 0.0
        assert (
            by_tier["memory"].bytes
            == by_tier["disk"].bytes
            == pool.stats()["tiers"]["memory"]["bytes"]
        )  # type: ignore[index]
    finally:
        pool.close()


def test_recent_ring_is_bounded(metrics: Metrics) -> None:
    from pdserve.metrics.prometheus import RECENT_KEEP

    class F:
        def __init__(self, i: int) -> None:
            self.rid, self.prompt_ids, self.sent = f"r{i}", [1], [2]
            self.timeline = [("arrive", "router", 0.0)]

    for i in range(RECENT_KEEP + 5):
        metrics.on_request_end(F(i), "ok")
    assert len(metrics.recent) == RECENT_KEEP and metrics.recent[-1].rid == f"r{RECENT_KEEP + 4}"
