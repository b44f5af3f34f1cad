"""RouterCore: the requester side of pdserve, on asyncio — dispatch, stream, retry, abort, trace.

For each request: pick P and D (or one colocated worker) with the pool's policy, send ExpectKV to
D and Prefill to P, then turn the `Tokens` events of both into one stream of `Delta`s. A failed
hand-off is retried once, resuming after the tokens already streamed (the new attempt prefills
prompt + those tokens), so a client never sees a token twice. A request that goes silent past
its deadline, or whose client goes away, is aborted on every worker it touched.

Workers are polled for stats every `stats_interval_s`; the replies feed /admin/workers, the metrics
and the policies (`roles`: a dispatch or a changed thread count samples the split). Liveness: every
`heartbeat_interval_s` the core pings each worker's heartbeat socket (a thread of the worker
answers: a long engine step is not death). A worker silent for `liveness_timeout_s`, or whose main
loop has not turned for `stuck_timeout_s`, is taken out of routing, and every request it was part of
is recovered: the other worker of the pair is told to abort, and the request is dispatched again (a
new attempt id), resuming after the tokens already streamed — at most `max_recoveries` times, then a
clear 503. With no healthy worker of a needed role, a request runs whole on any healthy one
(counted, in its timeline); with none it fails at once. A worker that answers rejoins routing.

This module is the request's life: generate, dispatch, failure and recovery. Beside it:
`delivery` (tokens in order, transfer reports), `links` (sockets, pools, stats, step logs),
`routing` (plan, admission, pick; decisions `decide`'s), `liveness` (heartbeats, calling back
`worker_down`), `roles` (role switching, autobalance, threads), `timeline(s)` (the event
vocabulary; kept timelines, scored predictions), `events` (counters and metrics in one sink)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq

from pdserve.config import RouterConfig
from pdserve.engine.request import SamplingParams
from pdserve.router import balancer, slo
from pdserve.router.delivery import Delivery
from pdserve.router.events import MetricsHooks, RouterEvents
from pdserve.router.flight import Delta, Flight, RequestError, WorkerState
from pdserve.router.links import Links, check_pairing
from pdserve.router.liveness import Liveness
from pdserve.router.pool_feedback import RECOVERY_ROUTE, PoolFeedback, kvpool_report
from pdserve.router.roles import Roles
from pdserve.router.routing import Routing
from pdserve.router.silence import SilenceWatch
from pdserve.router.threads import ThreadPolicy
from pdserve.router.timeline import Ev, Event, labelled, render
from pdserve.router.timelines import Timelines
from pdserve.router.worker_stats import WorkerStats
from pdserve.workers import messages as m

# Seconds a request may go without an event (at least 6x the hand-off deadline) before it ends
# with 504, unless it waits for its first token behind prompts its worker is still computing.
SILENCE_S = 30.0

__all__ = ["Delta", "Flight", "RequestError", "RouterCore", "WorkerState"]


class RouterCore:
    def __init__(
        self,
        endpoints: list[str],
        config: RouterConfig | None = None,
        *,
        metrics: MetricsHooks | None = None,
        ctx: zmq.Context | None = None,
        planner: slo.SloPlanner | None = None,
        autobalancer: balancer.Autobalancer | None = None,
        thread_policy: ThreadPolicy | None = None,
        **overrides: Any,
    ) -> None:
        """`config` (default: RouterConfig()) with `overrides` of its fields by name; with a
        planner (a cost model), routes are chosen and requests admitted by predicted TTFT/TPOT
        (router/slo.py), without one by the pools' policies."""
        self.config = cfg = dataclasses.replace(config or RouterConfig(), **overrides)
        self.events = RouterEvents(metrics)
        self.counters = self.events.counters
        self.links = Links(endpoints, ctx, self.events)
        self.workers = self.links.workers
        self.flights: dict[str, Flight] = {}
        self.planner = planner
        self.routing = Routing(
            self.links, self.events, planner, policy=cfg.policy, prefix_routing=cfg.prefix_routing
        )
        self.routing.local_tokens = cfg.conversation_local_tokens
        self.prefix, self.sessions = self.routing.prefix, self.routing.sessions
        self.pool_feedback = PoolFeedback(self.routing.pools, self.events, planner)
        self.liveness = Liveness(
            self.links,
            self.events,
            self.worker_down,
            interval_s=cfg.heartbeat_interval_s,
            timeout_s=cfg.liveness_timeout_s,
            stuck_s=cfg.stuck_timeout_s,
        )
        self.roles = Roles(
            self.links,
            self.events,
            self._busy,
            planner=planner,
            autobalancer=autobalancer,
            thread_policy=thread_policy,
            interval_s=cfg.autobalance_interval_s,
            drain_timeout_s=cfg.request_timeout_s,
            switch_timeout_s=max(5.0, cfg.deadline_s),
        )
        self.timelines = Timelines(self.events)
        self.delivery = Delivery(
            self.links, self.events, self.pool_feedback, self.timelines, planner
        )
        self._tasks: list[asyncio.Task] = []
        self._readers: dict[int, asyncio.Task] = {}  # id(WorkerState) -> its event reader

    @property
    def metrics(self) -> MetricsHooks | None:
        return self.events.metrics

    @metrics.setter
    def metrics(self, metrics: MetricsHooks | None) -> None:
        self.events.metrics = metrics

    def _busy(self, w: WorkerState) -> bool:
        """Whether a request in flight uses `w` (a draining worker waits for none)."""
        return any(f.pair is not None and w in f.pair for f in self.flights.values())

    # ---- life cycle ------------------------------------------------------------------------
    async def start(self, timeout_s: float = 120.0) -> None:
        """Say hello to every worker; raises RuntimeError naming those that never answer."""
        for w in self.workers:
            await self.links.hello(w)
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            await self.links.greeted(w, deadline, timeout_s)
        check_pairing(self.workers)
        for w in self.workers:
            self._watch(w)
        poll = self.links.poll_stats(self.config.stats_interval_s, self.config.deadline_s)
        self._tasks.append(asyncio.create_task(poll))
        self._tasks.append(asyncio.create_task(self.liveness.run()))
        self._tasks += [asyncio.create_task(job) for job in self.roles.loops()]

    def _watch(self, w: WorkerState) -> None:
        """Read the worker's events and ping its heartbeat socket."""
        self._readers[id(w)] = asyncio.create_task(self._reader(w))
        assert w.info is not None
        if w.info.hb_endpoint:
            self.liveness.connect(w, w.info.hb_endpoint)

    # ---- workers joining and leaving after start-up (pools resized by pdserve.ray) ---------
    async def add_worker(self, endpoint: str, timeout_s: float = 60.0) -> WorkerState:
        """Connect a worker that started after the router did; it enters routing once it has
        answered Hello. RuntimeError if it does not answer within `timeout_s`."""
        w = self.links.add(endpoint)
        try:
            await self.links.hello(w)
            await self.links.greeted(w, time.monotonic() + timeout_s, timeout_s)
            check_pairing(self.workers)
        except BaseException:
            self.links.remove(w)
            raise
        self._watch(w)
        self.events.count("workers_added")
        return w

    def remove_worker(self, w: WorkerState, reason: str = "removed") -> None:
        """Take `w` out of the router for good; a request still on it is recovered first (as
        when a worker dies), so none is lost."""
        if w.healthy and self._busy(w):
            self.worker_down(w, reason)
        w.healthy, w.down_reason = False, reason
        reader = self._readers.pop(id(w), None)
        if reader is not None:
            reader.cancel()
        self.liveness.disconnect(w)
        self.prefix.drop(w.worker_id)
        self.links.remove(w)
        self.events.count("workers_removed")

    async def drain_worker(self, w: WorkerState, timeout_s: float) -> bool:
        """Stop routing new requests to `w` and wait until none of its own is in flight (or
        `timeout_s` passes: False). The caller removes it; it stays out of routing."""
        w.draining = True
        ends = time.monotonic() + timeout_s
        while self._busy(w) and w.healthy:
            if time.monotonic() > ends:
                return False
            await asyncio.sleep(0.05)
        return True

    async def close(self) -> None:
        tasks = [*self._tasks, *self._readers.values(), *self.liveness.tasks()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.links.close()

    @property
    def model(self) -> str:
        return next((w.info.model for w in self.workers if w.info), "")

    # ---- one request -----------------------------------------------------------------------
    async def generate(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        session: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream a request's deltas; raises RequestError; cancelling it aborts everywhere.
        `session` (the client's conversation id) keeps a conversation where its KV is."""
        if rid in self.flights:
            raise RequestError(f"request id {rid!r} is in flight", 400, "invalid_request")
        if len(self.flights) >= self.config.max_inflight:
            # Overload is refused at once, before any prefill is spent (issue 6 predicts SLOs).
            self.events.overloaded()
            raise RequestError(
                f"{self.config.max_inflight} requests are in flight; retry shortly",
                429,
                "overloaded",
                retry_after_s=1,
            )
        flight = Flight(rid, list(prompt_ids), params, asyncio.Queue(), session=session)
        flight.timeline.append((Ev.ARRIVE, "router", time.monotonic()))
        self.flights[rid] = flight
        outcome = "error"
        try:
            self._dispatch(flight, admit=True)
            async for delta in self._drain(flight):
                yield delta
            outcome = "ok"
        except RequestError as e:
            # Refused before any work or token (overload, no workers): "rejected", not "error".
            if e.status in (429, 503) and not flight.sent:
                outcome = "rejected"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "aborted"
            raise
        finally:
            self._end(flight, outcome)

    async def _drain(self, flight: Flight) -> AsyncIterator[Delta]:
        ends = flight.timeline[0][2] + self.config.request_timeout_s  # no request outlives this
        ended = 0  # choices whose last delta was yielded (n > 1 ends choice by choice)
        watch = SilenceWatch(flight, max(SILENCE_S, 6 * self.config.deadline_s))
        while True:
            silence = watch.limit()
            left = ends - time.monotonic()
            try:
                item = await asyncio.wait_for(
                    flight.queue.get(), timeout=max(0, min(silence, left))
                )
            except TimeoutError:
                if time.monotonic() >= ends:
                    msg = f"request timed out after {self.config.request_timeout_s:g}s"
                    raise RequestError(msg, 504, "timeout") from None
                if (excuse := watch.excused(time.monotonic())) is not None:  # waiting, not lost
                    self.events.count(excuse)  # (request_timeout_s caps the waits)
                    continue
                raise RequestError(f"no progress for {silence:g}s", 504, "timeout") from None
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finish_reason is not None:
                ended += 1
                if ended >= flight.params.n:
                    return

    def _end(self, flight: Flight, outcome: str) -> None:
        if not flight.finished:
            self._abort_workers(flight)
        self._release(flight)
        self.flights.pop(flight.rid, None)
        if outcome == "ok":
            self.routing.remember_session(flight)
        end = Ev.FINISH if outcome == "ok" else outcome
        flight.timeline.append((end, "router", time.monotonic()))
        self.timelines.keep(flight)
        self.timelines.score(flight, outcome, self.planner)
        self.events.request_end(flight, outcome)

    # ---- dispatch --------------------------------------------------------------------------
    def _dispatch(
        self,
        flight: Flight,
        only: WorkerState | None = None,
        admit: bool = False,
        kind: str | None = None,
    ) -> None:
        """Send the request's current attempt to a P/D pair from the pools, or whole to `only`
        (the route named `kind`). `admit`: the first dispatch, which the planner may refuse."""
        if flight.params.n > 1 and (flight.sent or flight.sent_other):
            # n streams cannot resume as one: fail visibly rather than restart some choices
            raise RequestError(
                "a worker failed after this n > 1 request streamed tokens; it cannot resume",
                503,
                "worker_error",
            )
        flight.p_done, flight.held = False, []  # a new attempt starts from P again
        prompt = flight.prompt_ids + flight.sent  # a retry resumes after what was streamed
        self.routing.route(flight, prompt, admit, only, kind)
        self.roles.dispatched()  # a thread count it moves goes to P before the prompt
        assert flight.pair is not None
        self.pool_feedback.expect(flight, prompt)
        params = flight.params.to_wire()
        params["max_tokens"] = flight.params.max_tokens - len(flight.sent)
        first, second = flight.pair
        # n > 1: P samples every choice's first token, D forks the choices after one hand-off
        handoff = 1 if flight.params.n > 1 else self.config.handoff_tokens
        conv = flight.session or ""  # D keeps the turn's KV for the conversation's next turn
        if second is None:
            if first.role != "colocated" and only is None and flight.route == "fallback":
                # no healthy worker of the other role: this one runs the whole request
                self.events.count("local_fallbacks")
                flight.timeline.append((Ev.LOCAL_FALLBACK, first.worker_id, time.monotonic()))
            self._send(first, m.Generate(flight.wire_rid, prompt, params, conv))
            return
        assert second.info is not None
        expect = m.ExpectKV(flight.wire_rid, prompt, params, first.worker_id, handoff, conv)
        self._send(second, expect)
        kv_at = second.info.kv_endpoint
        self._send(
            first,
            m.Prefill(flight.wire_rid, prompt, params, second.worker_id, kv_at, handoff),
        )

    def _send(self, w: WorkerState, msg: object) -> None:
        self.links.send(w, msg)

    def _release(self, flight: Flight) -> None:
        for w in flight.pair or ():
            if w is not None:
                w.outstanding = max(0, w.outstanding - 1)
                flight.seen = w.load.remove(flight.rid) or flight.seen

    def _abort_workers(self, flight: Flight) -> None:
        for w in flight.pair or ():
            if w is not None:
                self._send(w, m.Abort(flight.wire_rid))

    async def abort(self, rid: str) -> bool:
        flight = self.flights.get(rid)
        if flight is None:
            return False
        flight.queue.put_nowait(RequestError("aborted", 499, "aborted"))
        return True

    # ---- events from workers ---------------------------------------------------------------
    async def _reader(self, w: WorkerState) -> None:
        while True:
            raw = await w.sock.recv()
            w.last_seen = time.monotonic()
            try:
                msg = m.decode(raw)
            except m.MessageError:
                self.events.count("bad_messages")
                continue
            self._on_event(w, msg)

    def _on_event(self, w: WorkerState, msg: object) -> None:
        if isinstance(msg, m.WorkerInfo):  # a rejoining worker's (maybe restarted) identity
            old = w.info.hb_endpoint if w.info else ""
            w.info = msg
            if msg.hb_endpoint and msg.hb_endpoint != old:  # restarted: a new heartbeat port
                self.liveness.connect(w, msg.hb_endpoint)
            return
        if isinstance(msg, m.KVEvents):
            self.prefix.apply(msg)
            if w.info is not None and w.info.kv_pools and msg.stored:
                self.routing.pools.add(w.info.kv_pools, msg.block_size, msg.stored)
            if self.prefix.needs_resync(msg.worker_id):  # a lost message: ask for a snapshot
                self.events.count("prefix_resyncs")
                self._send(w, m.Hello("router"))
            return
        if isinstance(msg, m.Steps):
            return self.links.step_logs.answer(msg)
        if isinstance(msg, m.Stats):
            before, w.stats = w.stats.threads, WorkerStats.from_report(msg.stats)
            self.roles.acknowledged(before, w.stats.threads)
            w.load.spec = w.stats.spec_per_step()
            if w.hb is None:  # with a heartbeat socket, health is the heartbeat's call
                w.healthy = True
            self.events.worker_stats(w, msg.stats)
            return
        rid, _, attempt = str(getattr(msg, "rid", "")).rpartition(".")
        flight = self.flights.get(rid)
        if flight is None and isinstance(msg, m.TransferReport):
            self.delivery.late_transfer(rid, attempt, msg)
            return
        if flight is None or attempt != str(flight.attempt):
            return  # finished, unknown, or about an earlier attempt
        flight.last_event = time.monotonic()
        if isinstance(msg, m.Tokens):
            self.delivery.tokens(flight, msg)
        elif isinstance(msg, m.TransferReport):
            self.delivery.transfer(flight, msg)
        elif isinstance(msg, m.RequestFailed):
            self._on_failed(flight, msg)

    def _on_failed(self, flight: Flight, msg: m.RequestFailed) -> None:
        self._abort_workers(flight)
        self._release(flight)
        flight.timeline.append((labelled(Ev.FAILED, msg.reason), msg.worker, time.monotonic()))
        if msg.stage == "transfer" and flight.attempt <= self.config.max_retries:
            self.events.retry(msg)
            flight.attempt += 1
            try:
                self._dispatch(flight)
                return
            except RequestError as e:
                flight.queue.put_nowait(e)
                return
        decode = flight.pair[1] if flight.pair else None
        if msg.stage == "transfer" and decode is not None and decode.healthy:
            # the link keeps failing: D computes the KV itself rather than receive it
            self.events.recompute()
            flight.attempt += 1
            flight.timeline.append((Ev.RECOMPUTE, decode.worker_id, time.monotonic()))
            self._dispatch(flight, only=decode)
            return
        status = 400 if msg.stage == "admission" else 503
        code = "invalid_request" if status == 400 else "worker_error"
        flight.queue.put_nowait(RequestError(msg.reason, status, code))

    # ---- liveness and recovery -------------------------------------------------------------
    def worker_down(self, w: WorkerState, reason: str) -> None:
        """Take `w` out of routing and recover every request it was part of."""
        w.healthy, w.down_reason = False, reason
        self.prefix.drop(w.worker_id)  # a restarted worker's cache is empty; it re-sends
        self.events.worker_down(w, reason)
        for flight in list(self.flights.values()):
            if flight.pair is not None and w in flight.pair and not flight.finished:
                self._recover(flight, w, reason)

    def _recover(self, flight: Flight, dead: WorkerState, reason: str) -> None:
        down = labelled(Ev.WORKER_DOWN, reason)
        flight.timeline.append((down, dead.worker_id, time.monotonic()))
        self._abort_workers(flight)  # the survivor frees its part; the dead one's is moot
        self._release(flight)
        if flight.recoveries >= self.config.max_recoveries:
            msg = f"worker {dead.worker_id} went down ({reason}); no recoveries left"
            flight.queue.put_nowait(RequestError(msg, 503, "worker_error"))
            return
        flight.recoveries += 1
        flight.attempt += 1
        self.events.count("recoveries")
        # a surviving D whose pool holds the context resumes it itself (router/pool_feedback)
        on_d = self.pool_feedback.recovery_target(flight, dead, self.workers)
        try:
            self._dispatch(flight, only=on_d, kind=RECOVERY_ROUTE if on_d else None)
        except RequestError as e:
            flight.queue.put_nowait(e)
            return
        first, second = flight.pair or (dead, None)
        how = "pair" if second is not None else first.role
        how = "pool" if on_d else "local" if how in ("prefill", "decode") else how
        self.events.recovered(how)

    # ---- roles, introspection (the HTTP app's and the cluster's API) -----------------------
    async def set_role(
        self, worker_id: str, role: str, by: str = "admin", timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Drain `worker_id` (no new requests; those it holds finish), switch its role, and let
        it rejoin routing. Raises RequestError: 404 unknown, 409 busy/unhealthy/not drained."""
        return await self.roles.set_role(worker_id, role, by, timeout_s)

    def pool_sample(self, now: float) -> balancer.PoolSample:
        """The autobalancer's view of the pools (an empty pool's work runs on the other)."""
        return self.roles.pool_sample(now)

    def worker_table(self) -> list[dict[str, Any]]:
        return self.links.table()

    def kvpool(self) -> dict[str, Any]:
        """GET /admin/kvpool (router/pool_feedback.py `kvpool_report`)."""
        return kvpool_report(self.workers, self.counters, self.routing.pools, self.pool_feedback)

    def worker_vitals(self) -> dict[str, dict[str, Any]]:
        """For the dashboard (router/dashboard.py): heartbeat age and last stats per worker."""
        return self.links.vitals()

    def prediction(self, rid: str) -> dict[str, Any] | None:
        return self.timelines.predictions.get(rid)

    def raw_timeline(self, rid: str) -> list[Event] | None:
        """(event, worker, time.monotonic()) with the workers' own stage names."""
        flight = self.flights.get(rid)
        if flight is not None:
            return sorted(flight.timeline, key=lambda e: e[2])
        return self.timelines.raw.get(rid)

    def timeline(self, rid: str) -> list[dict[str, Any]] | None:
        """The request's events for people: known stages under their public names (queue,
        prefill_start/end, transfer_start/end, decode_first_token), times in ms from arrival."""
        events = self.raw_timeline(rid)
        return None if events is None else render(events)
