"""The silence policy (router/silence.py): how long a request may wait for its next event, and
when a silent wait is queueing behind a worker's work rather than a lost request."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.router.silence import SilenceWatch, work_done
from pdserve.router.worker_stats import WorkerStats


def flight(stats: dict | None = None, ttft: float | None = None, first_at: float | None = None):  # type: ignore[no-untyped-def]
    pair = None if stats is None else (SimpleNamespace(stats=WorkerStats.from_report(stats)), None)
    pred = None if ttft is None else SimpleNamespace(ttft_s=ttft)
    return SimpleNamespace(pair=pair, prediction=pred, first_at=first_at)


def test_the_limit_stretches_to_three_predicted_ttfts_before_the_first_token() -> None:
    assert SilenceWatch(flight(), 30.0).limit() == 30.0  # no prediction: the base
    assert SilenceWatch(flight(ttft=20.0), 30.0).limit() == 60.0
    assert SilenceWatch(flight(ttft=5.0), 30.0).limit() == 30.0  # never below the base
    assert SilenceWatch(flight(ttft=20.0, first_at=1.0), 30.0).limit() == 30.0  # streaming


def test_queued_behind_work_only_while_the_worker_makes_progress() -> None:
    f = flight({"prefill_tokens": 100, "decode_tokens": 4})
    watch = SilenceWatch(f, 2.0)
    assert watch.mark == work_done(f) == 104
    assert not watch.queued_behind_work()  # nothing computed since: silent
    f.pair[0].stats = WorkerStats(prefill_tokens=300, decode_tokens=4)
    assert watch.queued_behind_work() and watch.mark == 304
    assert not watch.queued_behind_work()  # again nothing new
    f.pair[0].stats = WorkerStats(prefill_tokens=300, decode_tokens=9)
    f.first_at = 5.0  # its first token came: silence after that is not queueing
    assert not watch.queued_behind_work()


def test_a_worker_without_stats_yet_gets_one_more_wait() -> None:
    f = flight({})
    watch = SilenceWatch(f, 2.0)
    assert watch.mark is None and not watch.queued_behind_work()  # still nothing to go on
    f.pair[0].stats = WorkerStats(prefill_tokens=10)  # the first stats came during the wait
    assert watch.queued_behind_work()
    assert SilenceWatch(flight(None), 2.0).mark is None  # not dispatched yet


def _worker(loop_age: float, work_age: float, last_pong: float, healthy: bool = True):  # type: ignore[no-untyped-def]
    from pdserve.router.flight import WorkerState

    w = WorkerState("tcp://x", None)  # type: ignore[arg-type]
    w.healthy, w.loop_age, w.work_age, w.last_pong = healthy, loop_age, work_age, last_pong
    return w


def test_silence_inside_one_long_step_that_makes_progress_is_excused() -> None:
    """A decode whose worker's loop last turned before the request's last token, and whose
    layers keep finishing: its next token comes when that step ends (a big model's long
    prompt step). Once the loop turns without the request's token, silence counts again."""
    f = SimpleNamespace(
        pair=(_worker(0.0, -1.0, 0.0), _worker(40.0, 0.5, 100.0)),
        prediction=None,
        first_at=50.0,
        last_event=61.0,  # the step began at 100 - 40 = 60: before the last token (+ slack)
    )
    watch = SilenceWatch(f, 30.0)
    assert watch.current_worker() is f.pair[1]  # decoding: D's steps, not P's
    assert watch.excused(now=100.5) == "long_step_silence_extended"
    f.pair[1].loop_age = 10.0  # the loop turned at 90, after the last token: the request is lost
    assert watch.excused(now=100.5) is None
    f.pair[1].loop_age, f.pair[1].work_age = 40.0, 35.0  # no layer for 35 s: no progress
    assert watch.excused(now=100.5) is None
    f.pair[1].work_age, f.pair[1].healthy = 0.5, False  # taken out of routing
    assert watch.excused(now=100.5) is None
    old = _worker(40.0, -1.0, 100.0)  # a worker that does not report layer progress
    f.pair = (f.pair[0], old)
    assert watch.excused(now=100.5) is None  # its loop age (40 s) is its idle age


def test_before_the_first_token_the_prefilling_worker_is_watched() -> None:
    p = _worker(40.0, 0.2, 100.0)
    f = SimpleNamespace(pair=(p, _worker(0.0, 0.0, 100.0)), prediction=None, first_at=None,
                        last_event=60.5)  # fmt: skip
    watch = SilenceWatch(f, 30.0)
    assert watch.current_worker() is p and watch.excused(now=100.2) == "long_step_silence_extended"
