"""Delivery: a request's tokens from its workers to its client, in generation order, and what
its workers report about the KV hand-off (no sockets of its own: the core's reader calls it).

- `tokens`: P's and D's events travel on different sockets, so D's tokens can overtake P's
  hand-off tokens: they are held until P's are delivered. Each delivery feeds the loads' first
  token and token counts, the timeline (each worker's first tokens; a whole request's own
  stages) and the client's queue; the request's last choice ending on P frees D's reservation.
- `transfer`: a TransferReport's stamps go into the timeline; D's bytes teach the planner the
  KV bytes per token. `late_transfer`: one that arrives after the request finished.
"""

from __future__ import annotations

import time

from pdserve.router import slo
from pdserve.router.events import RouterEvents
from pdserve.router.flight import Delta, Flight, decode_load
from pdserve.router.links import Links
from pdserve.router.pool_feedback import PoolFeedback
from pdserve.router.timeline import Ev, Side, labelled, staged
from pdserve.router.timelines import Timelines
from pdserve.workers import messages as m


class Delivery:
    def __init__(
        self,
        links: Links,
        events: RouterEvents,
        pool_feedback: PoolFeedback,
        timelines: Timelines,
        planner: slo.SloPlanner | None,
    ) -> None:
        self.links, self.events, self.pool_feedback = links, events, pool_feedback
        self.timelines, self.planner = timelines, planner

    def tokens(self, flight: Flight, msg: m.Tokens) -> None:
        """Deliver tokens in generation order. P's and D's events travel on different sockets,
        so D's can overtake P's hand-off tokens: hold them until P's have been delivered."""
        first, second = flight.pair or (None, None)
        from_p = first is not None and second is not None and msg.worker == first.worker_id
        if second is not None and not from_p and not flight.p_done:
            flight.held.append(msg)
            return
        self._deliver(flight, msg)
        if from_p:
            flight.p_done = True
            held, flight.held = flight.held, []
            for early in held:
                self._deliver(flight, early)

    def _deliver(self, flight: Flight, msg: m.Tokens) -> None:
        now = time.monotonic()
        if msg.pool is not None:
            self.pool_feedback.on_report(flight, msg.worker, msg.pool, now)
        for key, n in (msg.spec or {}).items():  # the timeline's `speculation`
            flight.spec[key] = flight.spec.get(key, 0) + n
        if msg.cached >= 0:
            self._cached(flight, msg.worker, msg.cached, now)
        if msg.token_ids:
            if flight.first_at is None:
                dec = decode_load(flight)
                flight.held_at_first = 0.0 if dec is None else dec.held_s(now)
            flight.first_at = flight.first_at or now
            flight.last_at = now
            for w in flight.pair or ():
                if w is not None:
                    w.load.first_token(flight.rid, now)
                    w.load.tokens(flight.rid, len(msg.token_ids), now)
        seen = {w for e, w, _ in flight.timeline if e == Ev.FIRST_TOKEN}
        if msg.token_ids and msg.worker not in seen:  # each worker's first tokens: P's, then D's
            flight.timeline.append((Ev.FIRST_TOKEN, msg.worker, msg.time))
        colocated = flight.pair is not None and flight.pair[1] is None
        for stage, t in (msg.times or {}).items() if colocated else ():
            # A whole request on one worker: its own prefill stages (P and D report theirs in
            # TransferReport instead).
            flight.timeline.append((staged(Side.LOCAL, stage), msg.worker, t))
        if msg.index == 0:
            flight.sent += msg.token_ids  # what a retry resumes after (n = 1 only)
        else:
            flight.sent_other = True
        finish = msg.finish_reason if msg.finished else None
        flight.queue.put_nowait(
            Delta(msg.token_ids, msg.text, msg.logprobs, finish, msg.stop_reason, msg.index)
        )
        if msg.finished:
            flight.choices_done.add(msg.index)
        if msg.finished and len(flight.choices_done) >= flight.params.n:
            flight.finished = True
            first, second = flight.pair or (None, None)
            if second is not None and first is not None and msg.worker == first.worker_id:
                self.links.send(second, m.Abort(flight.wire_rid))  # done on P: free D's reservation

    def transfer(self, flight: Flight, msg: m.TransferReport) -> None:
        if self.planner is not None and msg.side == Side.RECV:
            cached = flight.prediction.cached_decode if flight.prediction else 0
            self.planner.observe_transfer(msg.nbytes, len(flight.prompt_ids) - cached)
        for stage, t in (msg.times or {}).items():
            flight.timeline.append((staged(msg.side, stage), msg.worker, t))
        if msg.cached >= 0:
            self._cached(flight, msg.worker, msg.cached, time.monotonic())
        self.events.transfer(msg)

    @staticmethod
    def _cached(flight: Flight, worker: str, tokens: int, now: float) -> None:
        """The first report per worker counts: D's hand-off report (the KV it held) comes
        before its own last tokens, which report the request's prompt as computed."""
        if worker in flight.cached:
            return
        flight.cached[worker] = tokens
        flight.timeline.append((labelled(Ev.CACHED, f"{tokens} tokens"), worker, now))

    def late_transfer(self, rid: str, attempt: str, msg: m.TransferReport) -> None:
        """P reports its side after D's ack, which can be after the request finished: still
        part of the request's timeline (and of the transfer counters)."""
        stamps = [(staged(msg.side, s), msg.worker, t) for s, t in (msg.times or {}).items()]
        if self.timelines.add_late(rid, attempt, stamps):
            self.events.transfer(msg)
