"""The heartbeat thread's own duties besides pongs: logging where a stalled main loop is."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from factories import eventually
from pdserve.workers.heartbeat import Heartbeat


def _stuck_in_a_known_place(release: threading.Event) -> None:
    release.wait(30)


def test_a_stalled_main_loop_is_logged_once_with_its_stack(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()
    loop = threading.Thread(target=_stuck_in_a_known_place, args=(release,), daemon=True)
    loop.start()
    tick = time.monotonic()
    ctx = zmq.Context()
    hb = Heartbeat(ctx, "inproc://hb-test", "W0", lambda: tick, lambda: loop.ident, 0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.worker.heartbeat"):
            eventually(lambda: hb.stalls_logged or None, 10.0, "the stall is logged")
            for _ in range(3):  # more checks of the same stall (the thread's own, here at once)
                hb._check_stall()
        assert hb.stalls_logged == 1
        (record,) = [r for r in caplog.records if "has not turned" in r.getMessage()]
        assert "W0" in record.getMessage() and "_stuck_in_a_known_place" in record.getMessage()
    finally:
        release.set()
        hb.close()
        ctx.term()


def test_a_loop_turning_within_the_limit_is_never_logged() -> None:
    ctx = zmq.Context()
    hb = Heartbeat(
        ctx, "inproc://hb-test-2", "W1", lambda: time.monotonic() - 0.1, lambda: None, 0.2
    )
    try:
        for _ in range(3):
            hb._check_stall()  # what the thread does after each poll: a loop 0.1 s old, under 0.2
        assert hb.stalls_logged == 0
    finally:
        hb.close()
        ctx.term()


def test_a_pong_reports_progress_inside_a_long_step() -> None:
    """The loop has not turned for 50 s, but a model layer finished 0.1 s ago: the pong says
    loop age ~50 s and work age ~0.1 s (busy, not stuck); without a work tick, -1."""
    from pdserve.workers import messages as m

    ctx = zmq.Context()
    now = time.monotonic()
    hb = Heartbeat(ctx, "inproc://hb-test-3", "W2", lambda: now - 50.0, work_tick=lambda: now - 0.1)
    plain = Heartbeat(ctx, "inproc://hb-test-4", "W3", lambda: now - 50.0)
    try:
        pongs = []
        for endpoint in ("inproc://hb-test-3", "inproc://hb-test-4"):
            sock = ctx.socket(zmq.DEALER)
            sock.connect(endpoint)
            sock.send(m.encode(m.Ping(1)))
            assert sock.poll(5000)
            pongs.append(m.decode(sock.recv()))
            sock.close(0)
        busy, unknown = pongs
        assert 50.0 <= busy.loop_age_s < 52.0 and 0.1 <= busy.work_age_s < 2.0
        assert 50.0 <= unknown.loop_age_s < 52.0 and unknown.work_age_s == -1.0
    finally:
        hb.close()
        plain.close()
        ctx.term()
