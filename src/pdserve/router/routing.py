"""Routing: which worker(s) an attempt of a request goes to, and whether it is admitted.

With a planner (a cost model) the route is the `SloPlanner`'s choice over the healthy pools, fed
with each worker's predicted load and the prompt tokens it caches (the prefix index, plus
session affinity); a first attempt predicted to miss its SLOs is refused (429). Without one,
the pools' policies pick a P/D pair, else a colocated worker, else any worker whole.
The chosen route is named in the timeline and the counters, and its work booked on the loads.
The decisions themselves are decide.py's, which the simulator calls too.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from pdserve.router import decide, slo
from pdserve.router.events import RouterEvents
from pdserve.router.flight import Flight, RequestError, WorkerState
from pdserve.router.links import ROLES, Links
from pdserve.router.policies import make_policy
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
        local_tokens: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`local_tokens`: without a planner, a follow-up whose tokens not cached on the D
        holding its conversation are at most this many is prefilled there (0: on P)."""
        self.links, self.events, self.planner = links, events, planner
        self.clock = clock  # the decisions' time (a test's own clock replays a sequence)
        self.prefix_routing = prefix_routing
        self.local_tokens = local_tokens
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
        elif (followed := self.follow(flight, prompt)) is not None:
            flight.pair, kind = followed
        else:
            flight.pair = self.pick()
        p = flight.params
        if decide.whole_on_decode(p.n, p.max_tokens, p.logprobs) and flight.pair[1]:
            self.events.count("n_choice_local")
            flight.pair = (flight.pair[1], None)
        for w in flight.pair:
            if w is not None:
                w.outstanding += 1
        now = self.clock()
        flight.timeline.append((Ev.DISPATCH, f"attempt {flight.attempt}", now))
        self._note_route(flight, planned, only is not None, now, kind)

    def plan(self, flight: Flight, prompt: list[int], admit: bool) -> tuple[Pair, slo.Prediction]:
        """The planner's route for this attempt; refuses (429) a first attempt that would miss."""
        assert self.planner is not None
        pools = self.links.pools()
        byid = {w.worker_id: w for pool in pools.values() for w in pool}
        if not byid:
            raise RequestError("no healthy workers to serve the request", 503, "unavailable")
        for w in byid.values():
            w.load.worker_id = w.worker_id
        cached = self.cached(prompt, flight.session, byid) if self.prefix_routing else {}
        self._history(flight, prompt, byid)
        pooled = self.pooled(prompt, byid) if self.prefix_routing else {}
        pair, decision = decide.plan(
            self.planner,
            pools,
            len(prompt),
            flight.params.max_tokens - len(flight.sent),
            self.clock(),
            cached=cached,
            pooled=pooled,
            admit_all=not admit,
            streams=flight.params.n,
        )
        if pair is None or decision.chosen is None:
            raise self._reject(flight, decision)
        if decision.probe:  # predicted to miss, admitted so the planner learns (slo.decide)
            self.events.count("admission_probes")
            flight.timeline.append((Ev.ADMITTED_TO_CALIBRATE, "router", self.clock()))
        return pair, decision.chosen

    def _reject(self, flight: Flight, decision: slo.Decision) -> RequestError:
        reason = decision.reject or "unavailable"
        self.events.refused(reason)
        flight.timeline.append((labelled(Ev.REJECTED, reason), "router", self.clock()))
        what = {"slo_ttft": "TTFT", "slo_tpot": "TPOT"}.get(reason)
        msg = (
            f"predicted to miss the {what} SLO on every route"
            if what
            else "admitting it would push queued prompts past the TTFT SLO"
            if reason == "slo_ttft_queued"
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
        """Prompt tokens each worker already caches (`decide.cached_tokens`), with the affinity
        of this conversation's last turn."""
        infos = [w.info for w in byid.values() if w.info is not None]
        if not infos:
            return {}
        last = self.sessions.get(session) if session else None
        return decide.cached_tokens(self.prefix, prompt, infos[0].block_size, list(byid), last)

    def pooled(self, prompt: list[int], byid: dict[str, WorkerState]) -> dict[str, int]:
        """Prompt tokens each worker could load from its KV pools (the pool index)."""
        workers = {wid: w.info.kv_pools for wid, w in byid.items() if w.info and w.info.kv_pools}
        return self.pools.match(prompt, workers) if workers else {}

    def follow(self, flight: Flight, prompt: list[int]) -> tuple[Pair, str] | None:
        """A conversation's follow-up without a planner: to the D that kept its last turn,
        prefilled there (local) when few of its tokens are not cached there, else on a P whose
        KV goes to that D (which skips the history it holds). None: not a follow-up of a
        healthy D's conversation."""
        if not self.prefix_routing or not flight.session:
            return None
        pools = self.links.pools()
        decoders = {w.worker_id: w for w in pools["decode"]}
        last = self.sessions.get(flight.session)
        if last is None or last[0] not in decoders:
            return None
        keeper = decoders[last[0]]
        self._history(flight, prompt, decoders)
        cached = self.cached(prompt, flight.session, decoders).get(keeper.worker_id, 0)
        if decide.follow_up_local(len(prompt), cached, self.local_tokens) or not pools["prefill"]:
            return (keeper, None), "local"
        return (decide.choose(self.policies["prefill"], pools["prefill"]), keeper), "remote"

    def _history(self, flight: Flight, prompt: list[int], byid: dict[str, WorkerState]) -> None:
        """Note what the worker keeping this conversation's last turn should hold of `prompt`
        (checked when the request ends: `remember_session`)."""
        last = self.sessions.get(flight.session) if flight.session else None
        keeper = byid.get(last[0]) if last is not None else None
        if last is None or keeper is None or keeper.info is None:
            return
        held = decide.history_tokens(last[1], prompt, keeper.info.block_size)
        flight.history = (keeper.worker_id, held) if held > 0 else None

    def remember_session(self, flight: Flight) -> None:
        """A finished turn of a conversation: its next turn prefers the worker holding its KV.
        A follow-up served by that worker is a hit when the worker had its whole history
        cached, else a miss (evicted: prefilled again), both counted and in the timeline."""
        if not flight.session or flight.pair is None:
            return
        self._score_history(flight)
        keeper = flight.pair[1] or flight.pair[0]
        self.sessions[flight.session] = (keeper.worker_id, flight.prompt_ids + flight.sent)
        self.sessions.move_to_end(flight.session)
        while len(self.sessions) > TIMELINE_KEEP:
            self.sessions.popitem(last=False)

    def _score_history(self, flight: Flight) -> None:
        if flight.history is None or flight.pair is None:
            return
        keeper, want = flight.history
        if keeper not in {w.worker_id for w in flight.pair if w is not None}:
            self.events.conversation("moved")  # the planner chose other workers
            return
        got = flight.cached.get(keeper, 0)
        hit = got >= want
        self.events.conversation("hit" if hit else "miss")
        what = f"hit {want} tokens" if hit else f"miss {got} of {want} tokens"
        flight.timeline.append((labelled(Ev.CONVERSATION, what), keeper, self.clock()))

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
        kind = (
            name
            if name is not None
            else decide.route_kind(first.role, second is not None, pred, forced)
        )
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
        tokens = flight.prompt_ids + flight.sent
        pooled = None
        if pred is None:  # a route the caller chose (a recovery): what its pool gives it
            found = self.pooled(tokens, {first.worker_id: first})
            pooled = min(found.get(first.worker_id, 0), len(tokens) - 1)
        decide.book(
            self.planner,
            flight.rid,
            (first.load, second.load if second is not None else None),
            len(tokens),
            flight.params.max_tokens - len(flight.sent),
            now,
            pred,
            pooled=pooled,
            streams=flight.params.n,
        )

    def pick(self) -> Pair:
        pair = decide.pick(self.links.pools(), self.policies)
        if pair is None:
            raise RequestError("no healthy workers to serve the request", 503, "unavailable")
        return pair
