"""A run's own level (sim/level.py): lone steps found by hand, ratios against hand-priced steps."""

from __future__ import annotations

import pytest

from pdserve.costmodel.model import CostModel
from pdserve.engine.step_log import StepRecord
from pdserve.sim.level import MIN_STEPS, lone_steps, run_level

# prefill of n new tokens: 0.1 + 0.001 n; decode of b rows: 0.05 + 0.01 b (no context terms)
MODEL = CostModel((0.1, 0.001, 0.0), (0.05, 0.01, 0.0))


def prefill(start: float, seconds: float, n: int = 100) -> StepRecord:
    return StepRecord(start, seconds, 0, 0, ((n, 0),))


def decode(start: float, seconds: float, batch: int = 1) -> StepRecord:
    return StepRecord(start, seconds, batch, 300 * batch, ())


def test_lone_steps_by_hand() -> None:
    a = [decode(0.0, 1.0), decode(1.0, 1.0), decode(5.0, 1.0)]
    b = [prefill(1.5, 1.0), prefill(3.0, 1.0), prefill(6.0, 0.5)]  # the last starts as a[2] ends
    lone = lone_steps({"A": a, "B": b})
    # a[1] = [1, 2) and b[0] = [1.5, 2.5) overlap; a[2] = [5, 6) and b[2] = [6, 6.5) only touch
    assert sorted(s.start for s in lone) == [0.0, 3.0, 5.0, 6.0]
    assert lone_steps({"A": a}) == a  # one worker: nothing overlaps


def test_run_level_is_the_median_ratio_of_lone_steps_by_kind() -> None:
    # priced by hand: prefill of 100 tokens 0.1 + 0.1 = 0.2 s; decode batch 1: 0.05 + 0.01 = 0.06
    pre = [prefill(10.0 * i, 0.2 * k) for i, k in enumerate((1.4, 1.5, 1.6, 1.5, 1.5))]
    dec = [decode(100.0 + i, 0.06 * k) for i, k in enumerate((1.1, 1.0, 1.2, 1.1, 1.1, 0.9))]
    mixed = StepRecord(200.0, 9.0, 1, 300, ((100, 0),))  # in neither kind
    overlapped = [decode(300.0, 9.0)], [prefill(300.5, 9.0)]  # in neither: they overlap
    logs = {"A": [*dec, mixed, *overlapped[0]], "B": [*pre, *overlapped[1]]}
    got = run_level(MODEL, logs)
    assert got["prefill_x"] == pytest.approx(1.5) and got["decode_x"] == pytest.approx(1.1)
    assert (got["prefill_steps"], got["decode_steps"]) == (5, 6)
    assert (got["steps"], got["lone_steps"], got["fallback"]) == (14, 12, [])
    assert got["from"] == "steps"


def test_too_few_lone_steps_leave_the_profile_level_and_say_so() -> None:
    few = [prefill(10.0 * i, 0.4) for i in range(MIN_STEPS - 1)]
    dec = [decode(100.0 + i, 0.12) for i in range(MIN_STEPS)]
    got = run_level(MODEL, {"P": few, "D": dec})
    assert got["prefill_x"] == 1.0 and got["fallback"] == ["prefill"]
    assert got["decode_x"] == pytest.approx(2.0)


def test_step_record_wire_round_trip_and_bad_length() -> None:
    s = StepRecord(12.5, 0.25, 2, 700, ((64, 0), (32, 128)))
    assert s.to_wire() == [12.5, 0.25, 2, 700, 64, 0, 32, 128]
    assert StepRecord.from_wire(s.to_wire()) == s
    with pytest.raises(ValueError, match="4 \\+ 2k"):
        StepRecord.from_wire([1.0, 2.0, 3.0, 4.0, 5.0])


def test_with_contention_every_step_counts_its_overlap_divided_out() -> None:
    from pdserve.costmodel.contention import Contention

    # a decode beside a prefill runs x2, a prefill beside a decode x1.25 (x1 otherwise)
    slow = Contention(prefill_by_decode=1.25, decode_by_prefill=2.0)
    # P: five prefills of 0.2 s priced (1.5x: 0.3 s of work alone), each fully beside D's decodes
    # for 0.2 of its seconds: 0.3 + 0.2 x (1 - 1/1.25) = 0.34 s measured
    pre = [prefill(10.0 * i, 0.34) for i in range(5)]
    # D: a decode of 0.06 s priced at 1.0x inside each prefill (0.06 x 2 = 0.12 s measured),
    # and five lone ones at 1.0x
    dec = [decode(10.0 * i + 0.1, 0.12) for i in range(5)]
    dec += [decode(100.0 + i, 0.06) for i in range(5)]
    # lone only: the prefills all overlap: too few
    assert run_level(MODEL, {"P": pre, "D": dec})["fallback"] == ["prefill"]
    got = run_level(MODEL, {"P": pre, "D": dec}, slow)
    # each prefill overlapped 0.12 s of decode: 0.34 - 0.12 x 0.2 = 0.316 of work, x1.58
    assert got["prefill_x"] == pytest.approx(0.316 / 0.2)
    assert got["decode_x"] == pytest.approx(1.0)  # 0.12 - 0.12 x 0.5 = 0.06
    assert got["fallback"] == [] and got["contention"] is True and got["mixed_steps"] == 0
    # without contention in the profile nothing is divided out
    flat = run_level(MODEL, {"P": pre, "D": dec}, Contention.none())
    assert flat["prefill_x"] == pytest.approx(1.7) and flat["decode_x"] == pytest.approx(1.5)


def test_mixed_steps_give_prefill_factors_at_the_decodes_factor() -> None:
    from pdserve.costmodel.contention import Contention

    dec = [decode(float(i), 0.12) for i in range(5)]  # decode x2
    # a mixed step of 1 decode + 400 tokens: decodes alone 0.06, with the chunk 0.51 (the
    # fixed term max(0.1, 0.05), + 0.4 + 0.01): chunk's price 0.45; measured at prefill x3:
    # 2 x 0.06 + 3 x 0.45 = 1.47
    mixed = [StepRecord(10.0 + 2 * i, 1.47, 1, 300, ((400, 0),)) for i in range(5)]
    small = StepRecord(30.0, 5.0, 8, 2400, ((10, 0),))  # chunk under half the price: skipped
    got = run_level(MODEL, {"C": [*dec, *mixed, small]}, Contention.none())
    assert got["decode_x"] == pytest.approx(2.0) and got["prefill_x"] == pytest.approx(3.0)
    assert got["mixed_steps"] == 5 and got["prefill_steps"] == 5
    assert run_level(MODEL, {"C": [*dec, *mixed]})["fallback"] == ["prefill"]  # lone only


def test_steps_on_other_threads_are_priced_at_theirs() -> None:
    """A model profiled on 1 thread; steps that ran on 2 are priced x 1 / speedup(2) (1.8)."""
    from pdserve.costmodel.capacity import speedup

    two = [StepRecord(float(i), 0.2 / speedup(2), 0, 0, ((100, 0),), threads=2) for i in range(5)]
    one = [StepRecord(10.0 + i, 0.06, 1, 300, (), threads=1) for i in range(5)]
    got = run_level(MODEL, {"P": two, "D": one}, threads=1)
    assert got["prefill_x"] == pytest.approx(1.0) and got["decode_x"] == pytest.approx(1.0)
    unknown = run_level(MODEL, {"P": two, "D": one})  # the model's threads unknown: as priced
    assert unknown["prefill_x"] == pytest.approx(1 / speedup(2))


def test_a_steps_message_with_and_without_threads() -> None:
    from pdserve.engine import step_log

    wire = [[1.0, 0.1, 2, 40], [2.0, 0.3, 0, 0, 64, 0]]
    assert [s.threads for s in step_log.from_wire(wire, [2, 1])] == [2, 1]
    assert [s.threads for s in step_log.from_wire(wire, [])] == [0, 0]
    with pytest.raises(ValueError, match="2 steps but 1 thread"):
        step_log.from_wire(wire, [2])
    log = step_log.StepLog()
    log.add(StepRecord(5.0, 0.1, 1, 9, (), threads=2))
    assert log.wire_since(4.0) == ([[5.0, 0.1, 1, 9]], [2]) and log.wire_since(6.0) == ([], [])
