"""Workers freeze their start-up heap and time every garbage collection (workers/gc_pauses.py)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator

import pytest

from pdserve.workers.gc_pauses import GcPauses


@pytest.fixture
def pauses() -> Iterator[GcPauses]:
    p = GcPauses().install()
    try:
        yield p
    finally:
        p.close()
    assert p._on_gc not in gc.callbacks  # closed: nothing left hooked into the collector


@pytest.fixture
def unfreeze() -> Iterator[None]:
    try:
        yield
    finally:
        gc.unfreeze()  # the rest of the test session collects normally


def test_every_collection_is_counted_by_generation(pauses: GcPauses) -> None:
    before = pauses.stats()
    gc.collect(0)
    gc.collect(2)
    gc.collect(2)
    after = pauses.stats()
    assert pauses.collections[2] >= 2 and pauses.collections[0] >= 1
    assert after["gc_full_collections"] - before["gc_full_collections"] >= 2
    assert after["gc_collections"] - before["gc_collections"] >= 3
    assert after["gc_pause_seconds"] > before["gc_pause_seconds"]
    assert 0 < after["gc_max_pause_seconds"] <= after["gc_pause_seconds"]


def test_a_long_pause_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    p = GcPauses(warn_s=0.0).install()  # every pause is "long"
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.workers.gc_pauses"):
            gc.collect()
    finally:
        p.close()
    assert any("garbage collection of generation 2" in r.message for r in caplog.records)


def test_install_twice_hooks_once(pauses: GcPauses) -> None:
    pauses.install()
    assert gc.callbacks.count(pauses._on_gc) == 1


def test_freezing_takes_startup_objects_out_of_the_collectors_reach(
    pauses: GcPauses, unfreeze: None
) -> None:
    survivor = [{"start-up": i} for i in range(1000)]  # containers the collector tracks
    before = pauses.stats()
    frozen = pauses.freeze_startup_heap()
    # A frozen object whose last reference goes (a log record's temporaries, a thread's
    # frame) leaves the permanent generation, so the count can only fall after the call.
    assert frozen >= gc.get_freeze_count() >= len(survivor)
    assert pauses.stats()["gc_frozen_objects"] == frozen  # counted once, not per stats call
    # Its own collection is start-up work, not a pause of the serving loop: not counted.
    assert pauses.stats()["gc_full_collections"] == before["gc_full_collections"]
    assert pauses.stats()["gc_pause_seconds"] == before["gc_pause_seconds"]
    tracked = {id(o) for o in gc.get_objects()}
    assert id(survivor) not in tracked and id(survivor[0]) not in tracked
    later = [{"after": 1}]
    assert id(later) in {id(o) for o in gc.get_objects()}  # new objects are still collected


def test_worker_processes_report_their_frozen_heap_and_pauses(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    from pdserve.cluster import LocalCluster

    with LocalCluster(str(tiny_llama_path), transport="tcp") as c:
        stats = c.worker_stats()
    assert set(stats) == {"P0", "D0"}
    for s in stats.values():
        assert s["gc_frozen_objects"] > 1000  # the process entry froze the engine's heap
        assert s["gc_max_pause_seconds"] < 0.05  # and its own collection is not a pause
        for key in ("gc_collections", "gc_full_collections", "gc_pause_seconds"):
            assert s[key] >= 0
