"""How long one request may go without an event before the router ends it with 504.

Pure policy over a `Flight` (no asyncio): `RouterCore._drain` asks for the current limit before
each wait, and when a wait times out, whether the request is queued behind work its worker is
still doing (waiting, not lost) rather than silent.
"""

from __future__ import annotations

from pdserve.router.flight import Flight


def work_done(flight: Flight) -> int | None:
    """Tokens computed so far by the worker that prefills this request (its stats, polled every
    second), or None before it is dispatched or reports."""
    if flight.pair is None:
        return None
    stats = flight.pair[0].stats
    if stats.prefill_tokens is None:
        return None
    return stats.prefill_tokens + stats.decode_tokens


class SilenceWatch:
    """One request's silence limit, and the progress of the worker it is queued on."""

    def __init__(self, flight: Flight, base_s: float) -> None:
        self.flight, self.base_s = flight, base_s
        self.mark = work_done(flight)

    def limit(self) -> float:
        """A request queued behind others legitimately waits its predicted TTFT (heartbeats,
        not silence, tell a dead worker), so before its first token the limit stretches to 3x
        that."""
        f = self.flight
        if f.first_at is None and f.prediction is not None:
            return max(self.base_s, 3 * f.prediction.ttft_s)
        return self.base_s

    def queued_behind_work(self) -> bool:
        """After a silent wait: is the request still before its first token while its worker
        computed more tokens since the last look? (A 2000-token prompt takes ~15 s on one CPU
        thread.) With no look yet (the worker's first stats came during this wait), one more
        wait is granted."""
        done = work_done(self.flight)
        if (
            self.flight.first_at is None
            and done is not None
            and (self.mark is None or done > self.mark)
        ):
            self.mark = done
            return True
        return False
