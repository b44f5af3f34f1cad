"""Where worker actors go (pdserve/ray/placement.py): pure, no Ray needed."""

from __future__ import annotations

import pytest

from pdserve.ray.placement import Placement, fits, placement, ray_address, threads_for


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
