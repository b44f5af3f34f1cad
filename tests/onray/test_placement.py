"""Where worker actors go (pdserve/ray/placement.py): pure, no Ray needed."""

from __future__ import annotations

import pytest

from pdserve.ray.placement import Placement, fits, placement, ray_address, threads_for
from pdserve.ray.scaling import PoolAutoscaler
from pdserve.router.balancer import PoolSample
from pdserve.workers import auth


def test_custom_resources_place_by_role_else_cpus() -> None:
    cluster = {"CPU": 8.0, "pdserve_decode": 2.0}
    assert placement("decode", cluster, 2) == Placement(2, {"pdserve_decode": 1.0})
    assert placement("prefill", cluster, 2) == Placement(2)  # no prefill nodes named: CPUs
    assert placement("prefill", {"CPU": 4.0, "pdserve_prefill": 1.0}, 1).options() == {
        "num_cpus": 1,
        "resources": {"pdserve_prefill": 1.0},
    }


def test_bad_roles_and_cpus_are_value_errors() -> None:
    with pytest.raises(ValueError, match="role"):
        placement("router", {}, 1)
    with pytest.raises(ValueError, match="cpus"):
        placement("decode", {}, 0)


def test_fits_needs_cpus_and_the_role_resource() -> None:
    p = Placement(2, {"pdserve_decode": 1.0})
    assert fits(p, {"CPU": 2.0, "pdserve_decode": 1.0})
    assert not fits(p, {"CPU": 1.0, "pdserve_decode": 1.0})
    assert not fits(p, {"CPU": 4.0})
    assert fits(Placement(1), {"CPU": 1.0})


def test_threads_come_from_the_actors_cpus() -> None:
    assert threads_for({"CPU": 3.0, "pdserve_decode": 1.0}) == 3
    assert threads_for({"CPU": 0.5}) == 1
    assert threads_for({}) == 1


def test_ray_address() -> None:
    assert ray_address("auto") is None
    assert ray_address("ray://head:10001") == "ray://head:10001"
    with pytest.raises(ValueError, match="auto"):
        ray_address(" ")


def test_serve_on_a_ray_cluster_refuses_to_start_without_a_secret(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pdserve.cli import build_parser
    from pdserve.serve import flags
    from pdserve.serve import ray as on_ray

    monkeypatch.delenv(auth.ENV, raising=False)
    args = build_parser().parse_args(["serve", "--ray", "head:6379", "--cost-model", "none"])
    with pytest.raises(ValueError, match="not loopback"):
        on_ray.run(flags.deployment(args))  # before connecting to Ray or loading anything


# ---- the autoscaling policy (pdserve/ray/scaling.py) ---------------------------------------------
def sample(p: float, d: float, n_p: int = 1, n_d: int = 1) -> PoolSample:
    return PoolSample(p, d, n_p, n_d)


def test_a_saturated_pool_grows_only_after_sustain_and_with_room() -> None:
    s = PoolAutoscaler(floor={"prefill": 1, "decode": 1}, sustain_s=5, cooldown_s=20)
    room = {"prefill": True, "decode": True}
    assert s.observe(0, sample(0.5, 0.9), room) is None
    assert s.observe(4, sample(0.5, 0.9), room) is None  # not sustained yet
    assert s.observe(5, sample(0.5, 0.9), room) == ("grow", "decode")
    assert s.observe(10, sample(0.5, 0.9, 1, 2), room) is None  # cooling down
    assert s.observe(26, sample(0.5, 0.9, 1, 2), {"decode": False}) is None  # no room
    assert s.changes == 1


def test_a_lapse_restarts_the_sustain_clock() -> None:
    s = PoolAutoscaler(floor={}, sustain_s=5, cooldown_s=0)
    room = {"prefill": True}
    assert s.observe(0, sample(0.9, 0.2), room) is None
    assert s.observe(3, sample(0.5, 0.2), room) is None  # below high: starts over
    assert s.observe(6, sample(0.9, 0.2), room) is None
    assert s.observe(11, sample(0.9, 0.2), room) == ("grow", "prefill")


def test_an_idle_pool_shrinks_back_to_its_start_size_but_not_below() -> None:
    s = PoolAutoscaler(floor={"prefill": 1, "decode": 1}, sustain_s=5, cooldown_s=0)
    assert s.observe(0, sample(0.0, 0.0, 1, 2), {}) is None
    assert s.observe(5, sample(0.0, 0.0, 1, 2), {}) == ("shrink", "decode")
    assert s.observe(6, sample(0.0, 0.0, 1, 1), {}) is None
    assert s.observe(20, sample(0.0, 0.0, 1, 1), {}) is None  # at the floor


def test_a_pool_at_its_ceiling_does_not_grow() -> None:
    s = PoolAutoscaler(floor={"decode": 1}, ceiling={"decode": 2}, sustain_s=0, cooldown_s=0)
    room = {"prefill": True, "decode": True}
    assert s.observe(0, sample(0.5, 0.9, 1, 1), room) == ("grow", "decode")
    assert s.observe(1, sample(0.5, 0.9, 1, 2), room) is None  # saturated, at the ceiling
    assert s.observe(2, sample(0.9, 0.9, 1, 2), room) == ("grow", "prefill")  # no cap on P


def test_bad_thresholds_are_value_errors() -> None:
    with pytest.raises(ValueError, match="idle"):
        PoolAutoscaler(floor={}, idle=0.8, high=0.7)
    with pytest.raises(ValueError, match="below the floor"):
        PoolAutoscaler(floor={"decode": 2}, ceiling={"decode": 1})
