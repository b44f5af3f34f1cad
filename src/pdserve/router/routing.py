"""Routing: which worker(s) an attempt of a request goes to, and whether it is admitted.

With a planner (a cost model) the route is the `SloPlanner`'s choice over the healthy pools, fed
with each worker's predicted load and the prompt tokens it caches (the prefix index, plus
session affinity); a first attempt predicted to miss its SLOs is refused (429). Without one,
the pools' policies pick a P/D pair, else a colocated worker, else any worker whole.
The chosen route is named in the timeline and the counters, and its work booked on the loads.
"""

from __future__ import annotations

import collections
import time

from pdserve.router import slo
from pdserve.router.events import RouterEvents
from pdserve.router.flight import Flight, RequestError, WorkerState
from pdserve.router.links import ROLES, Links
from pdserve.router.policies import WorkerLoad, make_policy
from pdserve.router.pool_index import PoolIndex
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.timeline import TIMELINE_KEEP, Ev, labelled

Pair = tuple[WorkerState, WorkerState | None]


class Routing:
    def __init__(
        self,
        links: Links,
        events: RouterEvents,
        planner: slo.SloPlanner | None,
        *,
        policy: str,
        prefix_routing: bool,
    ) -> None:
        self.links, self.events, self.planner = links, events, planner
        self.prefix_routing = prefix_routing
        self.prefix = PrefixIndex()
        self.pools = PoolIndex()  # what the workers' KV pools hold (their stored hashes)
        # conversation (OpenAI `user`) -> (worker that served its last turn, its tokens)
        self.sessions: collections.OrderedDict[str, tuple[str, list[int]]] = (
            collections.OrderedDict()
        )
        self.policies = {role: make_policy(policy) for role in ROLES}

    def route(
        self,
        flight: Flight,
        prompt: list[int],
        admit: bool,
        only: WorkerState | None,
        kind: str | None = None,
    ) -> None:
        """Set `flight.pair` for this attempt (whole on `only` if given), name and book it.
        `admit`: the first dispatch, which the planner may refuse (RequestError 429); `kind`:
        the route's name when the caller chose `only` (default: recompute or local)."""
        planned = None
        if only is not None:
            flight.pair = (only, None)
        elif self.planner is not None:
            flight.pair, planned = self.plan(flight, prompt, admit)
        else:
            flight.pair = self.pick()
        p = flight.params
        if p.n > 1 and (p.max_tokens == 1 or p.logprobs is not None) and flight.pair[1]:
            # n one-token choices end on P (nothing to hand over), and P does not send the
            # logprobs of the choices' first tokens: D runs these whole (one prefill there)
            self.events.count("n_choice_local")
            flight.pair = (flight.pair[1], None)
        for w in flight.pair:
            if w is not None:
                w.outstanding += 1
        now = time.monotonic()
        flight.timeline.append((Ev.DISPATCH, f"attempt {flight.attempt}", now))
        self._note_route(flight, planned, only is not None, now, kind)

    def plan(self, flight: Flight, prompt: list[int], admit: bool) -> tuple[Pair, slo.Prediction]:
        """The planner's route for this attempt; refuses (429) a first attempt that would miss."""
        assert self.planner is not None
        pools = self.links.pools()
        routes = self.planner.routes(*([w.worker_id for w in pools[r]] for r in ROLES))
        if not routes:
            raise RequestError("no healthy workers to serve the request", 503, "unavailable")
        byid = {w.worker_id: w for pool in pools.values() for w in pool}
        for w in byid.values():
            w.load.worker_id = w.worker_id
        cached = self.cached(prompt, flight.session, byid) if self.prefix_routing else {}
        pooled = self.pooled(prompt, byid) if self.prefix_routing else {}
        max_tokens = flight.params.max_tokens - len(flight.sent)
        loads = {wid: w.load for wid, w in byid.items()}
        decision = self.planner.decide(
            len(prompt),
            max_tokens,
            routes,
            loads,
            cached,
            time.monotonic(),
            admit_all=not admit,
            streams=flight.params.n,
            pooled=pooled,
        )
        if decision.chosen is None:
            raise self._reject(flight, decision)
        chosen = decision.chosen
        second = byid[chosen.route.decode] if chosen.route.decode is not None else None
        return (byid[chosen.route.first], second), chosen

    def _reject(self, flight: Flight, decision: slo.Decision) -> RequestError:
        reason = decision.reject or "unavailable"
        self.events.refused(reason)
        flight.timeline.append((labelled(Ev.REJECTED, reason), "router", time.monotonic()))
        what = {"slo_ttft": "TTFT", "slo_tpot": "TPOT"}.get(reason)
        msg = (
            f"predicted to miss the {what} SLO on every route"
            if what
            else "admitting it would push running requests past the TPOT SLO"
        )
        return RequestError(
            f"{msg}; retry after {decision.retry_after_s}s",
            429,
            reason,
            retry_after_s=decision.retry_after_s,
        )

    def cached(
        self, prompt: list[int], session: str | None, byid: dict[str, WorkerState]
    ) -> dict[str, int]:
        """Prompt tokens each worker already caches: the index of its published block hashes;
        for the worker that served this conversation's last turn, at least what that turn left
        there when the index has not heard from it (affinity survives a lagging index)."""
        infos = [w.info for w in byid.values() if w.info is not None]
        if not infos:
            return {}
        bs = infos[0].block_size
        cached = self.prefix.match(prompt, bs, list(byid))
        last = self.sessions.get(session) if session else None
        if last is not None and last[0] in byid and self.prefix.needs_resync(last[0]):
            common = 0
            for a, b in zip(last[1], prompt, strict=False):
                if a != b:
                    break
                common += 1
            cached[last[0]] = max(cached.get(last[0], 0), common // bs * bs)
        return cached

    def pooled(self, prompt: list[int], byid: dict[str, WorkerState]) -> dict[str, int]:
        """Prompt tokens each worker could load from its KV pools (the pool index)."""
        workers = {wid: w.info.kv_pools for wid, w in byid.items() if w.info and w.info.kv_pools}
        return self.pools.match(prompt, workers) if workers else {}

    def remember_session(self, flight: Flight) -> None:
        """A finished turn of a conversation: its next turn prefers the worker holding its KV."""
        if not flight.session or flight.pair is None:
            return
        keeper = flight.pair[1] or flight.pair[0]
        self.sessions[flight.session] = (keeper.worker_id, flight.prompt_ids + flight.sent)
        self.sessions.move_to_end(flight.session)
        while len(self.sessions) > TIMELINE_KEEP:
            self.sessions.popitem(last=False)

    def _note_route(
        self,
        flight: Flight,
        pred: slo.Prediction | None,
        forced: bool,
        now: float,
        name: str | None = None,
    ) -> None:
        """Name the attempt's route (timeline, counters) and book its work on the loads."""
        assert flight.pair is not None
        first, second = flight.pair
        if name is not None:
            kind = name
        elif pred is not None:
            kind = pred.route.kind
        elif second is not None:
            kind = "remote"
        elif forced:
            kind = "recompute" if first.role == "decode" else "local"
        else:
            kind = "colocated" if first.role == "colocated" else "fallback"
        flight.route = kind
        self.events.route(kind)
        where = first.worker_id + (f"->{second.worker_id}" if second is not None else "")
        flight.timeline.append((labelled(Ev.ROUTE, kind), where, now))
        if pred is not None and flight.prediction is None:
            flight.prediction = pred
            flight.raw_pred = (
                self.planner.uncalibrated(pred) if self.planner else (pred.ttft_s, pred.tpot_s)
            )
        if self.planner is not None:
            self._book(flight, pred, now)

    def _book(self, flight: Flight, pred: slo.Prediction | None, now: float) -> None:
        assert self.planner is not None and flight.pair is not None
        first, second = flight.pair
        n = len(flight.prompt_ids) + len(flight.sent)
        out = max(1, min(flight.params.max_tokens - len(flight.sent), self.planner.expected_output))
        cached = pred.cached_first if pred is not None else 0
        pooled = pred.pooled_first if pred is not None else 0
        if pred is None:  # a route the caller chose (a recovery): what its pool gives it
            found = self.pooled(flight.prompt_ids + flight.sent, {first.worker_id: first})
            pooled = min(found.get(first.worker_id, 0), n - 1)
        prefill = self.planner.prefill_time(n, cached, first.load, pooled)
        streams = flight.params.n  # n choices decode as n sequences
        if second is None:
            first.load.add(slo.Job(flight.rid, prefill, n, out, True, now, streams=streams))
            return
        first.load.add(slo.Job(flight.rid, prefill, 0, 0, False, now))
        second.load.add(slo.Job(flight.rid, 0.0, n, out, True, now, streams=streams))

    def pick(self) -> Pair:
        pools = self.links.pools()
        if pools["prefill"] and pools["decode"]:
            return self._choose("prefill", pools["prefill"]), self._choose(
                "decode", pools["decode"]
            )
        if pools["colocated"]:
            return self._choose("colocated", pools["colocated"]), None
        for role in ("decode", "prefill"):  # a pool is empty: degrade to whole requests
            if pools[role]:
                return self._choose(role, pools[role]), None
        raise RequestError("no healthy workers to serve the request", 503, "unavailable")

    def _choose(self, role: str, pool: list[WorkerState]) -> WorkerState:
        loads = [
            WorkerLoad(w.worker_id, w.outstanding, int(w.stats.get("waiting", 0))) for w in pool
        ]
        chosen = self.policies[role].pick(loads)
        return next(w for w in pool if w.worker_id == chosen.worker_id)
