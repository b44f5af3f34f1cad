"""The planner's view of a decode batch over an answer: the arrival rate over a window, the
batch a running request meets as the others finish, and the calibration compared at the batch
a request actually met."""

from __future__ import annotations

import pytest

from pdserve.costmodel.model import CostModel
from pdserve.router.arrivals import HORIZON_S, Arrivals
from pdserve.router.batch import drained
from pdserve.router.loads import Job, WorkerLoad
from pdserve.router.slo import Route, SloPlanner

# a decode step of 20 ms + 10 ms a request, no context term; prefills 1 ms a token
MODEL = CostModel((0.0, 1e-3, 0.0), (0.02, 0.01, 0.0), (0.0, 1e9))


def test_the_rate_over_a_window_counts_the_idle_time_and_not_the_request_deciding() -> None:
    a = Arrivals()
    for t in (10.0, 10.5, 11.0, 11.5):  # a burst of four in 1.5 s
        a.add(t)
    assert a.rate() == pytest.approx(3 / 1.5)  # the last arrivals: the burst's own rate
    assert a.rate_over(11.5, 15.0) == pytest.approx(3 / 15)  # the one at 11.5 is deciding
    assert a.rate_over(12.0, 1.0) == pytest.approx(2 / 1.0)  # [11.0, 12.0)
    assert a.rate_over(12.0, 0.0) == 0.0
    a.add(11.5 + HORIZON_S + 1)  # older ones are dropped past the horizon
    assert a.rate_over(11.5 + HORIZON_S + 2, 10 * HORIZON_S) == pytest.approx(1 / HORIZON_S)


def test_drained_batches_by_hand() -> None:
    jobs = [
        Job("a", 0.0, 100, 10, True, 0.0),
        Job("b", 0.0, 200, 20, True, 0.0),
        Job("c", 0.0, 300, 40, True, 0.0, streams=2),
    ]
    got = drained(jobs)
    assert got["a"] == pytest.approx((4.0, 900.0))  # everyone for all its 10 steps
    assert got["b"] == pytest.approx((3.5, 850.0))  # a for half of its 20
    assert got["c"] == pytest.approx((2.75, 725.0))  # a a quarter, b half of its 40
    assert drained([]) == {}


def test_a_request_just_admitted_behind_a_draining_batch_is_not_pushed_over() -> None:
    p = SloPlanner(MODEL, slo_tpot_s=0.0905, slo_ttft_s=100.0, kv_bytes_per_token=1.0)
    route = Route("remote", "P0", "D0")

    def d_with(old_steps_left: int) -> dict[str, WorkerLoad]:
        ls = {"P0": WorkerLoad("P0"), "D0": WorkerLoad("D0")}
        for i in range(6):  # six with a few steps left, decoding
            ls["D0"].add(Job(f"old{i}", 0.0, 100, old_steps_left, True, 0.0, first_at=0.0,
                             generated=300 - old_steps_left))  # fmt: skip
        ls["D0"].add(Job("young", 0.0, 100, 300, True, 0.0))  # its KV on the way
        return ls

    # at the batch of the moment (7, 90 ms) for all its 300 steps the young one sits at the
    # SLO and one more would push it over; the six leave after 2 steps, and it decodes alone
    draining = p.predict(100, 50, route, d_with(2), {}, now=1.0)
    assert draining.running_worst_s == 0.0 and draining.miss is None
    assert p.decide(100, 50, [route], d_with(2), {}, now=1.0).chosen is not None
    # the same batch with its whole answers ahead: the young one is protected
    staying = p.predict(100, 50, route, d_with(300), {}, now=1.0)
    assert staying.running_worst_s > 0.0905 and staying.miss is not None


def test_a_request_counts_the_batch_it_decoded_in_and_calibration_compares_there() -> None:
    w = WorkerLoad("D0")
    w.add(Job("a", 0.0, 100, 10, True, 0.0, first_at=0.0))
    w.add(Job("b", 0.0, 300, 10, True, 0.0, first_at=0.0))
    w.tokens("a", 1, 0.1)  # a batch of 2: contexts 100 and 300 when counted
    w.tokens("b", 1, 0.1)  # the same step's token: the same count
    assert w.remove("b") == pytest.approx((2.0, 400.0))
    w.tokens("a", 3, 0.2)  # three steps alone (context 101)
    assert w.remove("a") == pytest.approx(((2 + 3) / 4, (400 + 3 * 101) / 4))
    assert w.remove("a") is None
    w.add(Job("c", 1.0, 100, 10, True, 0.0))  # removed before a token: nothing seen
    assert w.remove("c") is None
    # predicted 30 ms a token at the model's step for a batch of 1; it met a batch of 6 (the
    # model's 80 ms) and took 160 ms: 2x the model there, not 5.3x the prediction
    p = SloPlanner(MODEL)
    p.learn((1.0, 0.03, 0.03), None, 0.16, 300, seen=(6.0, 0.0))
    assert p.calibration.tpot == pytest.approx(0.8 + 0.2 * 2.0)
    q = SloPlanner(MODEL)
    q.learn((1.0, 0.03, 0.03), None, 0.16, 300)  # no batch seen: against the prediction
    assert q.calibration.tpot == pytest.approx(0.8 + 0.2 * 4.0)  # clamped at 4x
