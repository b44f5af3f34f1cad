"""The native kernels let go of the GIL while they run. A worker's heartbeat thread answers the
router's pings (workers/heartbeat.py); a kernel call holding the GIL for seconds (a long prompt
step of a 1-2B model on the decode format's kernels) silenced it, and the router took the busy
worker for dead (no_heartbeat) and refused its requests."""

from __future__ import annotations

import sys
import threading
import time

import torch

from pdserve.engine import kernels


def test_python_threads_run_while_a_kernel_computes() -> None:
    ops = kernels.load("w8g32")
    q, s = ops.pack(torch.randn(2048, 2048))
    x = torch.randn(512, 2048)
    ops.matmul(x[:16], q, s, 2048)  # warm
    looping, done, span = threading.Event(), threading.Event(), []

    def call() -> None:
        assert looping.wait(10)  # the loop below is running
        t0 = time.perf_counter()
        ops.matmul(x, q, s, 2048)
        span.extend((t0, time.perf_counter()))
        done.set()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        worker = threading.Thread(target=call)
        worker.start()
        stamps, last = [], 0.0
        while not done.is_set():  # the heartbeat thread's part: turns while the call runs
            now = time.perf_counter()
            if now - last > 1e-4:
                stamps.append(now)
                last = now
                looping.set()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    # Holding the GIL, the call would let no Python run between its start and its end, past
    # the switch interval either side (this loop may hold the GIL that long after the thread
    # reads the clock, before the call and after it).
    margin = 2 * sys.getswitchinterval()
    start, end = span[0] + margin, span[1] - margin
    assert end - start > 0.01, "the call is too short to tell"
    inside = sum(start < t < end for t in stamps)
    assert inside >= 10, (inside, span[1] - span[0])
