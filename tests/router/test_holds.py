"""D's holds (`hold_decode`) and the planner's calibration: a request's TPOT is learned less
the seconds its decode worker was told to hold, which the step model does not predict."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.router.loads import WorkerLoad, less_held
from pdserve.router.timelines import _stepping_tpot


def test_the_hold_clock_counts_only_the_seconds_held() -> None:
    d = WorkerLoad("D0")
    assert d.held_s(5.0) == 0.0
    d.set_held(True, 1.0)
    d.set_held(True, 2.0)  # told again: the hold started at 1.0
    assert d.held_s(3.0) == pytest.approx(2.0)
    assert d.held_s(0.5) == 0.0  # before the hold began: nothing
    d.set_held(False, 4.0)
    d.set_held(False, 6.0)
    assert d.held_s(9.0) == pytest.approx(3.0)
    d.set_held(True, 10.0)
    assert d.held_s(10.5) == pytest.approx(3.5)


def test_a_requests_learned_tpot_leaves_out_its_decoders_holds() -> None:
    p, d = WorkerLoad("P0"), WorkerLoad("D0")
    d.set_held(True, 0.0)
    d.set_held(False, 1.0)  # a hold before the request's first token: not its own
    first = 2.0
    flight = SimpleNamespace(
        pair=(SimpleNamespace(load=p), SimpleNamespace(load=d)),
        held_at_first=d.held_s(first),
        last_at=12.0,
    )
    d.set_held(True, 5.0)
    d.set_held(False, 8.0)  # 3 s held during its 101 tokens' 10 s
    tpot = (12.0 - first) / 100
    assert _stepping_tpot(flight, tpot, 101) == pytest.approx(7.0 / 100)  # type: ignore[arg-type]
    assert _stepping_tpot(flight, None, 101) is None  # type: ignore[arg-type]
    local = SimpleNamespace(pair=(SimpleNamespace(load=d), None), held_at_first=1.0, last_at=12.0)
    assert _stepping_tpot(local, tpot, 101) == pytest.approx(7.0 / 100)  # type: ignore[arg-type]


def test_less_held_spreads_the_held_seconds_over_the_tokens_after_the_first() -> None:
    assert less_held(0.1, 3.0, 101) == pytest.approx(0.07)
    assert less_held(None, 3.0, 101) is None
    assert less_held(0.01, 3.0, 101) is None  # held longer than it decoded: nothing to learn
