"""A worker Ray cannot place says why, on /admin/pools, the dashboard and `pdserve top`, over a
fake cluster (ray/pending.py's ClusterView): no Ray started."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from fake_core import FakeCore
from fastapi.testclient import TestClient

from pdserve.ray.pending import pending_reasons
from pdserve.ray.placement import Placement, shortfall
from pdserve.ray.pools import Member, PoolSpec, RayPools
from pdserve.router import dashboard
from pdserve.router.app import create_app

pytest.importorskip("ray")  # RayPools imports it (nothing is started)


class FakeCluster:
    """Two CPUs, both held by P0 and D0; actors the test names are not placed."""

    def __init__(self, unplaced: set[str], total: Mapping[str, float] | None = None) -> None:
        self.unplaced = unplaced
        self.total = dict(total or {"CPU": 2.0})
        self.free = {"CPU": 0.0}

    def cluster_resources(self) -> Mapping[str, float]:
        return self.total

    def available_resources(self) -> Mapping[str, float]:
        return self.free

    def actor_state(self, actor: Any) -> str | None:
        return "PENDING_CREATION" if actor in self.unplaced else "ALIVE"


def test_shortfall_names_the_first_missing_resource() -> None:
    assert shortfall(Placement(1.0), {"CPU": 0.0}) == "needs CPU 1.0, 0 free"
    assert shortfall(Placement(0.5), {"CPU": 0.25}) == "needs CPU 0.5, 0.25 free"
    decode = Placement(1.0, {"pdserve_decode": 1.0})
    assert shortfall(decode, {"CPU": 4.0}) == "needs pdserve_decode 1.0, 0 free"
    assert shortfall(decode, {"CPU": 1.0, "pdserve_decode": 1.0}) is None


def test_only_unplaced_workers_are_pending() -> None:
    view = FakeCluster({"d1"})
    starting = [("D1", "decode", "d1"), ("D2", "decode", "d2")]  # D2 is placed, loading
    assert pending_reasons(starting, view, 1.0) == [
        {"worker": "D1", "role": "decode", "reason": "pending: needs CPU 1.0, 0 free"}
    ]
    view.free = {"CPU": 1.0}  # room, but Ray has not placed it yet (another node's CPUs)
    assert pending_reasons(starting[:1], view, 1.0)[0]["reason"].startswith(
        "pending: waits for Ray to place it"
    )


def pools_with_a_pending_decode() -> RayPools:
    pools = RayPools(PoolSpec(cpus_per_worker=1.0), None, view=FakeCluster({"d1"}))
    pools.members = [
        Member("P0", "prefill", "p0", "start", state="up"),
        Member("D0", "decode", "d0", "start", state="up"),
        Member("D1", "decode", "d1", "admin"),  # POST /admin/pools {"decode": 2}
    ]
    return pools


def test_admin_pools_the_dashboard_and_top_say_why(default_tokenizer: Any) -> None:
    from pdserve import top

    pools = pools_with_a_pending_decode()
    app = create_app(FakeCore(), default_tokenizer, model_name="m", scaler=pools)
    client = TestClient(app)
    status = client.get("/admin/pools").json()
    decode = status["pools"]["decode"]
    assert (decode["target"], decode["up"], decode["starting"], decode["pending"]) == (2, 1, 0, 1)
    why = {"worker": "D1", "role": "decode", "reason": "pending: needs CPU 1.0, 0 free"}
    assert status["pending"] == [why]
    snap = client.get(dashboard.JSON_PATH).json()
    assert dashboard.Snapshot.model_validate(snap).pending[0].reason == why["reason"]
    assert snap["pending"] == [why]
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(top.pools(snap))
    assert "pending: needs CPU 1.0, 0 free" in console.export_text()


def test_without_a_scaler_nothing_is_pending(default_tokenizer: Any) -> None:
    client = TestClient(create_app(FakeCore(), default_tokenizer, model_name="m"))
    assert client.get(dashboard.JSON_PATH).json()["pending"] == []


def test_ray_unreachable_leaves_the_status_without_reasons() -> None:
    pools = pools_with_a_pending_decode()

    def fail() -> Mapping[str, float]:
        raise ConnectionError("GCS gone")

    pools.view.available_resources = fail  # type: ignore[method-assign]
    status = pools.status()
    assert status["pending"] == [] and status["pools"]["decode"]["starting"] == 1
