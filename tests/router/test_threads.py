"""The thread policy (router/threads.py): stats in, target threads per worker out."""

from __future__ import annotations

import pytest

from pdserve.router.balancer import PoolSample
from pdserve.router.threads import ThreadPolicy, ThreadSample, handover, share

P, D = ("P0",), ("D0",)


def sample(p: float = 0.0, d: float = 0.0, *, p_idle: bool = False, d_idle: bool = False):  # type: ignore[no-untyped-def]
    return ThreadSample(PoolSample(p, d, len(P), len(D)), P, D, p_idle, d_idle)


def run(policy: ThreadPolicy, s: ThreadSample, t0: float, t1: float, dt: float = 0.1):  # type: ignore[no-untyped-def]
    """Observe `s` every `dt` from t0 to t1; the last targets."""
    out: dict[str, int] = {}
    t = t0
    while t <= t1 + 1e-9:
        out = policy.observe(t, s)
        t += dt
    return out


def test_both_busy_starts_from_an_even_split_and_never_exceeds_the_cores() -> None:
    policy = ThreadPolicy(cores=8)
    targets = policy.observe(0.0, sample(0.5, 0.5))
    assert targets == {"P0": 4, "D0": 4} and policy.state == "split"


def test_p_idle_lends_every_core_to_d_and_work_on_p_takes_them_back_at_once() -> None:
    policy = ThreadPolicy(cores=4, park_after_s=0.5)
    assert policy.observe(0.0, sample(p_idle=True)) == {"P0": 2, "D0": 2}  # not idle long yet
    assert run(policy, sample(p_idle=True), 0.1, 0.6) == {"P0": 1, "D0": 4}
    assert policy.state == "lend_decode"
    assert policy.observe(0.7, sample(0.2, 0.1)) == {"P0": 2, "D0": 2}  # a prompt arrived
    assert policy.state == "split" and policy.moves == 2


def test_d_idle_lends_to_p_and_both_idle_stays_split() -> None:
    policy = ThreadPolicy(cores=4, park_after_s=0.0)
    assert policy.observe(0.0, sample(0.5, d_idle=True)) == {"P0": 4, "D0": 1}
    fresh = ThreadPolicy(cores=4, park_after_s=0.0)
    assert fresh.observe(0.0, sample(p_idle=True, d_idle=True)) == {"P0": 2, "D0": 2}


def test_p_over_its_ttft_budget_gets_a_core_when_d_has_slack_after_sustain() -> None:
    policy = ThreadPolicy(cores=4, sustain_s=1.0, cooldown_s=2.0)
    assert run(policy, sample(p=0.9, d=0.1), 0.0, 0.9) == {"P0": 2, "D0": 2}
    assert run(policy, sample(p=0.9, d=0.1), 1.0, 1.0) == {"P0": 3, "D0": 1}
    # D keeps at least one thread, however long P stays over
    assert run(policy, sample(p=0.9, d=0.1), 1.1, 30.0) == {"P0": 3, "D0": 1}


def test_p_over_but_d_without_slack_moves_nothing() -> None:
    policy = ThreadPolicy(cores=4, sustain_s=0.0, cooldown_s=0.0)
    assert run(policy, sample(p=2.0, d=0.5), 0.0, 10.0) == {"P0": 2, "D0": 2}
    assert policy.moves == 0


def test_d_losing_its_tpot_slack_gets_cores_back_even_with_p_over() -> None:
    policy = ThreadPolicy(cores=6, sustain_s=0.0, cooldown_s=1.0, p_cores=5)
    targets = run(policy, sample(p=0.9, d=0.9), 0.0, 0.05)
    assert targets == {"P0": 4, "D0": 2}
    assert run(policy, sample(p=0.9, d=0.9), 0.1, 0.9) == {"P0": 4, "D0": 2}  # cooldown
    assert run(policy, sample(p=0.9, d=0.9), 1.0, 1.0) == {"P0": 3, "D0": 3}


def test_pressures_inside_the_band_do_not_flap() -> None:
    policy = ThreadPolicy(cores=4, sustain_s=1.0, cooldown_s=0.0)
    for i in range(100):  # P over, D alternating above low and below: never sustained
        d = 0.1 if i % 2 else 0.5
        policy.observe(i * 0.3, sample(p=0.9, d=d))
    assert policy.moves == 0


def test_several_workers_per_pool_share_the_pool_and_bad_settings_raise() -> None:
    assert share(["a", "b", "c"], 7) == {"a": 3, "b": 2, "c": 2}
    assert share(["a", "b"], 1) == {"a": 1, "b": 1}
    policy = ThreadPolicy(cores=8)
    s = ThreadSample(PoolSample(0.5, 0.5, 2, 2), ("P0", "P1"), ("D0", "D1"), False, False)
    assert policy.observe(0.0, s) == {"P0": 2, "P1": 2, "D0": 2, "D1": 2}
    with pytest.raises(ValueError, match="at least 2 cores"):
        ThreadPolicy(cores=1)
    with pytest.raises(ValueError, match="low < high"):
        ThreadPolicy(cores=2, low=0.8, high=0.7)
    with pytest.raises(ValueError, match="as many cores"):
        ThreadPolicy(cores=2).observe(0.0, s)


def test_handover_frees_cores_before_giving_them() -> None:
    current = {"P0": 2, "D0": 2}
    targets = {"P0": 1, "D0": 3}
    assert handover(current, targets) == {"P0": 1}  # D waits for P's shrink
    assert handover({"P0": 1, "D0": 2}, targets) == {"D0": 3}
    assert handover({"P0": 1, "D0": 3}, targets) == {}
    assert handover({}, {"P0": 2}) == {"P0": 2}  # not reported yet: sent
