"""The draft pacer (engine/spec/pacing.py): pure step times and counts in, a cap out."""

from __future__ import annotations

from pdserve.engine.spec.pacing import PROBE_EVERY, DraftPacer


def _pacer(times: dict[int, float], accepted: int, rejected: int, max_k: int = 4) -> DraftPacer:
    p = DraftPacer(max_k)
    for rows, t in times.items():
        p.observe_step(rows, t, pure_decode=True)
    p._accepted, p._rejections = float(accepted), float(rejected)
    return p


def test_nothing_measured_means_a_plain_step_first() -> None:
    assert DraftPacer(4).cap(1) == 0


def test_unmeasured_rows_are_tried_when_drafts_are_accepted() -> None:
    # only the plain step measured: the verify rows are priced as it (optimistic) -> max k
    assert _pacer({1: 0.010}, accepted=9, rejected=1).cap(1) == 4


def test_cap_is_the_k_with_most_tokens_per_second() -> None:
    # rows cost: 2 rows as 1, then 5 ms per row (compute-bound small model)
    times = {1: 0.008, 2: 0.008, 3: 0.013, 4: 0.018, 5: 0.023}
    # acceptance 0.5: k=1 gives 1.5 tokens in 8 ms; k=2 1.75 in 13 ms -> 1
    assert _pacer(times, accepted=5, rejected=5).cap(1) == 1
    # acceptance 0.95: k=4 gives 4.52 tokens in 23 ms (196/s) vs k=1 1.95 in 8 ms (244/s) -> 1
    assert _pacer(times, accepted=95, rejected=5).cap(1) == 1
    # rows nearly free (weight-bound): the most drafts
    flat = {1: 0.010, 2: 0.010, 3: 0.0101, 4: 0.0102, 5: 0.0103}
    assert _pacer(flat, accepted=8, rejected=2).cap(1) == 4


def test_never_accepted_drafts_stop_drafting_but_probe_now_and_then() -> None:
    times = {1: 0.008, 2: 0.010, 3: 0.013, 4: 0.018, 5: 0.023}
    p = _pacer(times, accepted=0, rejected=50)
    caps = [p.cap(1) for _ in range(PROBE_EVERY)]
    assert caps[:-1] == [0] * (PROBE_EVERY - 1) and caps[-1] == 1
    assert p.capped_steps == PROBE_EVERY


def test_batch_scales_the_rows_priced() -> None:
    # batch 4: k drafts run 4 (1 + k) rows
    times = {4: 0.010, 8: 0.030, 12: 0.050, 16: 0.070, 20: 0.090}
    assert _pacer(times, accepted=9, rejected=1).cap(4) == 0  # every verify costs >= 3x


def test_steps_with_prompt_chunks_price_nothing_and_averages_move() -> None:
    p = DraftPacer(4)
    p.observe_step(5, 0.5, pure_decode=False)
    assert p.price(5) is None
    p.observe_step(5, 0.010, pure_decode=True)
    p.observe_step(5, 0.020, pure_decode=True)
    assert 0.010 < (p.price(5) or 0) < 0.020
    assert p.price(7) == p.price(5) and p.price(3) is None


def test_acceptance_is_accepted_over_accepted_plus_rejections() -> None:
    p = DraftPacer(4)
    for _ in range(200):
        p.observe_verify(4, 2)  # two accepted, then a rejection
    assert abs(p.acceptance - 2 / 3) < 0.02
