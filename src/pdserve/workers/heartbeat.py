"""A worker's heartbeat: a thread with its own socket that answers `Ping` with `Pong`.

Why a thread: the main loop answers its control socket only between engine steps, and one
prefill step of a long prompt takes seconds on a CPU, so a router judging liveness by control
replies would call a busy worker dead. torch releases the GIL inside its kernels, so this thread
answers within milliseconds while a step runs. A process that is gone or stopped (SIGSTOP, a
frozen VM) answers nothing. A process whose main loop hangs still answers, but its `loop_age_s`
(time since the loop last turned) grows, so the router can tell "stuck" from "busy"; and
`work_age_s` (since the loop turned or a model layer finished) stays small through one long step
(a 2048-token step of a 1.7B model takes half a minute on two cores), so busy is not stuck.

A loop that has not turned for `stall_log_s` is also logged once per stall, with the stack of
the thread that runs it: a router calls a worker stuck after 30 s, and the log then says where
it was (a CI run once lost a decode worker that way with nothing to show why).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

import zmq

from pdserve.workers import messages as m

log = logging.getLogger("pdserve.worker.heartbeat")


class Heartbeat:
    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        worker_id: str,
        loop_tick: Callable[[], float],
        loop_thread: Callable[[], int | None] = lambda: None,
        stall_log_s: float = 10.0,
        work_tick: Callable[[], float] | None = None,
    ) -> None:
        self.worker_id, self.loop_tick = worker_id, loop_tick
        self.work_tick = work_tick  # when the model last finished a layer (None: unknown)
        self.loop_thread, self.stall_log_s = loop_thread, stall_log_s
        self.stalls_logged = 0
        self._logged_tick: float | None = None  # the loop_tick of the stall last logged
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self.paused = False  # fault injection: a worker whose heartbeat is silent
        # the socket was made here, but only the thread uses it from now on (zmq sockets are
        # not thread-safe; handing one over before first use is allowed)
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(100):
                    try:
                        self._answer()
                    except Exception:  # never let one bad ping end liveness for good
                        log.exception("heartbeat: could not answer a ping")
                self._check_stall()
        finally:
            self.sock.close(0)

    def _answer(self) -> None:
        parts = self.sock.recv_multipart()
        if len(parts) != 2 or self.paused:
            return
        try:
            ping = m.decode(parts[1])
        except m.MessageError:
            return  # not ours to argue with: liveness only
        if isinstance(ping, m.Ping):
            now, tick = time.monotonic(), self.loop_tick()
            work = -1.0 if self.work_tick is None else now - max(tick, self.work_tick())
            pong = m.Pong(ping.seq, self.worker_id, max(0.0, now - tick), max(-1.0, work))
            self.sock.send_multipart([parts[0], m.encode(pong)], zmq.NOBLOCK)

    def _check_stall(self) -> None:
        tick = self.loop_tick()
        age = time.monotonic() - tick
        if age < self.stall_log_s or tick == self._logged_tick:
            return
        self._logged_tick = tick
        ident = self.loop_thread()
        frame = sys._current_frames().get(ident) if ident is not None else None
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(unknown)\n"
        log.warning(
            "%s: main loop has not turned for %.1f s; it is at:\n%s", self.worker_id, age, where
        )
        # Counted once logged: a reader seeing the count finds the record (a test that waited
        # on the count read the records while this thread was still formatting the stack).
        self.stalls_logged += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
