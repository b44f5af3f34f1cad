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
