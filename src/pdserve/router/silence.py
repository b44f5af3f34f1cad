"""How long one request may go without an event before the router ends it with 504.

Pure policy over a `Flight` (no asyncio): `RouterCore._drain` asks for the current limit before
each wait, and when a wait times out, whether the silence is excused (`excused`): the request is
queued behind work its worker is still doing, or its worker is inside one long step that began
before the request's last event (its next token comes when that step ends; a big model's
2048-token step runs for half a minute on two cores). Otherwise it is lost: 504.
"""

from __future__ import annotations

from pdserve.router.flight import Flight, WorkerState

# A step began before the request's last event if the worker's loop last turned no later than
# this after it (the token is sent as the step ends, the loop turns right after).
TURN_SLACK_S = 1.0


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

    def excused(self, now: float) -> str | None:
        """After a silent wait: the counter naming why the request is not lost, or None."""
        if self.queued_behind_work():
            return "queued_silence_extended"
        if self.in_long_step(now):
            return "long_step_silence_extended"
        return None

    def in_long_step(self, now: float) -> bool:
        """Is the worker that owes the request its next token healthy, still finishing model
        layers, and in a step that began no later than the request's last event? Each wait
        grants this once per step: once a step ends without the request's token, silence
        counts."""
        w = self.current_worker()
        if w is None or not w.healthy:
            return False
        turned_at = w.last_pong - w.loop_age
        return turned_at <= self.flight.last_event + TURN_SLACK_S and w.idle_age < self.base_s

    def current_worker(self) -> WorkerState | None:
        """The worker the request's next event comes from: the prefilling one before the
        first token, the decoding one after."""
        pair = self.flight.pair
        if pair is None:
            return None
        return pair[0] if self.flight.first_at is None or pair[1] is None else pair[1]
