"""Routing policies on plain worker loads (no sockets)."""

from __future__ import annotations

import pytest

from pdserve.router.policies import POLICIES, WorkerLoad, make_policy


def _pool(*outstanding: int, waiting: tuple[int, ...] = ()) -> list[WorkerLoad]:
    waits = waiting or (0,) * len(outstanding)
    return [
        WorkerLoad(f"w{i}", o, w) for i, (o, w) in enumerate(zip(outstanding, waits, strict=True))
    ]


def test_least_outstanding_picks_the_least_loaded_then_the_shorter_queue() -> None:
    policy = make_policy("least_outstanding")
    assert policy.pick(_pool(3, 1, 2)).worker_id == "w1"
    assert policy.pick(_pool(1, 1, 4, waiting=(5, 2, 0))).worker_id == "w1"


def test_round_robin_cycles_through_the_pool() -> None:
    policy = make_policy("round_robin")
    pool = _pool(9, 0, 0)
    assert [policy.pick(pool).worker_id for _ in range(4)] == ["w0", "w1", "w2", "w0"]


def test_registry_names_and_unknown_policy() -> None:
    assert set(POLICIES) == {"least_outstanding", "round_robin"}
    with pytest.raises(ValueError, match="least_outstanding"):
        make_policy("random")
