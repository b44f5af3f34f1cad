"""RouterCore: the requester side of pdserve, on asyncio — dispatch, stream, retry, abort, trace.

For each request: pick P and D (or one colocated worker) with the pool's policy, send ExpectKV to
D and Prefill to P, then turn the `Tokens` events of both into one stream of `Delta`s. A failed
hand-off is retried once, resuming after the tokens already streamed (the new attempt prefills
prompt + those tokens), so a client never sees a token twice. A request that goes silent past
its deadline, or whose client goes away, is aborted on every worker it touched.

Workers are polled for stats every `stats_interval_s`; the replies feed /admin/workers, the
metrics and the policies.

Liveness: every `heartbeat_interval_s` the core pings each worker's heartbeat socket (answered by
a thread of the worker, so a long engine step does not look like death). A worker silent for
`liveness_timeout_s`, or whose main loop has not turned for `stuck_timeout_s`, is taken out of
routing, and every request it was part of is recovered: the other worker of the pair is told to
abort, and the request is dispatched again (a new attempt id), resuming after the tokens already
streamed — at most `max_recoveries` times, then a clear 503. With no healthy worker of a needed
role, a request runs whole on any healthy worker (counted, and in its timeline); with none at
all it fails at once. A worker that answers again rejoins routing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pdserve.engine.request import SamplingParams
from pdserve.router import balancer, slo
from pdserve.router.policies import WorkerLoad, make_policy
from pdserve.router.prefix_index import PrefixIndex
from pdserve.workers import messages as m

TIMELINE_KEEP = 2000  # finished requests whose timelines stay queryable

# Worker stage stamps -> the timeline's event names.
_STAGES = {
    "send:received": "queue",
    "send:prefill_start": "prefill_start",
    "send:first_token": "prefill_end",
    "send:ready": "transfer_start",
    "recv:done": "transfer_end",
    "local:prefill_start": "prefill_start",
    "local:first_token": "prefill_end",
}


class RequestError(Exception):
    """A request that cannot be served; `status` is the HTTP status the router answers with."""

    def __init__(
        self,
        message: str,
        status: int = 503,
        code: str = "unavailable",
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code
        self.retry_after_s = retry_after_s  # sent as Retry-After on 429/503


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class WorkerState:
    endpoint: str
    sock: zmq.asyncio.Socket
    info: m.WorkerInfo | None = None
    healthy: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    outstanding: int = 0
    last_seen: float = 0.0
    hb: zmq.asyncio.Socket | None = None  # heartbeat socket (Ping -> Pong)
    last_pong: float = 0.0
    loop_age: float = 0.0  # the worker's own report: since its main loop last turned
    down_reason: str | None = None  # why it was taken out of routing
    draining: bool = False  # out of routing until its requests finish (a role switch)
    load: slo.WorkerLoad = field(default_factory=lambda: slo.WorkerLoad(""))

    @property
    def worker_id(self) -> str:
        return self.info.worker_id if self.info else self.endpoint

    @property
    def role(self) -> str:
        return self.info.role if self.info else "unknown"


@dataclass
class Flight:
    """One request in flight; `attempt` changes the id the workers see on every retry."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    attempt: int = 1
    pair: tuple[WorkerState, WorkerState | None] | None = None
    sent: list[int] = field(default_factory=list)  # tokens already streamed to the client
    timeline: list[tuple[str, str, float]] = field(default_factory=list)
    last_event: float = field(default_factory=time.monotonic)
    finished: bool = False
    p_done: bool = False  # P's hand-off tokens delivered (D's may be delivered after them)
    held: list[m.Tokens] = field(default_factory=list)  # D's tokens that overtook P's
    recoveries: int = 0  # re-dispatches after a worker of this request went down
    session: str | None = None  # the client's conversation (OpenAI `user`): affinity
    route: str = ""  # remote | local | colocated | fallback
    prediction: slo.Prediction | None = None  # the planner's, for the first dispatch
    raw_pred: tuple[float, float] = (0.0, 0.0)  # the same before online calibration
    first_at: float | None = None  # router time of the first and last tokens delivered
    last_at: float | None = None

    @property
    def wire_rid(self) -> str:
        return f"{self.rid}.{self.attempt}"


class RouterCore:
    def __init__(
        self,
        endpoints: list[str],
        *,
        policy: str = "least_outstanding",
        deadline_s: float = 5.0,
        max_retries: int = 1,
        handoff_tokens: int = 1,
        stats_interval_s: float = 1.0,
        metrics: Any = None,
        ctx: zmq.Context | None = None,
        max_inflight: int = 256,
        heartbeat_interval_s: float = 0.5,
        liveness_timeout_s: float = 2.0,
        stuck_timeout_s: float = 30.0,
        max_recoveries: int = 2,
        request_timeout_s: float = 600.0,
        planner: slo.SloPlanner | None = None,
        prefix_routing: bool = True,
        autobalancer: balancer.Autobalancer | None = None,
        autobalance_interval_s: float = 1.0,
    ) -> None:
        if autobalancer is not None and planner is None:
            raise ValueError("autobalance needs a cost model (a planner)")
        self.autobalancer, self.autobalance_interval_s = autobalancer, autobalance_interval_s
        # With a planner (a cost model), routes are chosen and requests admitted by predicted
        # TTFT/TPOT (router/slo.py); without one, by the pools' policies.
        self.planner = planner
        self.prefix_routing = prefix_routing
        self.prefix = PrefixIndex()
        self.sessions: collections.OrderedDict[str, tuple[str, list[int]]] = (
            collections.OrderedDict()
        )
        self.predictions: dict[str, dict[str, Any]] = {}  # kept beside raw_timelines
        self.max_inflight = max_inflight
        self.heartbeat_interval_s, self.liveness_timeout_s = (
            heartbeat_interval_s,
            liveness_timeout_s,
        )
        self.stuck_timeout_s, self.max_recoveries = stuck_timeout_s, max_recoveries
        self.request_timeout_s = request_timeout_s
        # In-process (inproc) workers need the context they were started with.
        self.ctx = zmq.asyncio.Context.shadow(ctx) if ctx is not None else zmq.asyncio.Context()
        self._owns_ctx = ctx is None
        self.workers = [WorkerState(e, self._socket(e)) for e in endpoints]
        self.policies = {role: make_policy(policy) for role in ("prefill", "decode", "colocated")}
        self.deadline_s, self.max_retries = deadline_s, max_retries
        self.handoff_tokens, self.stats_interval_s = handoff_tokens, stats_interval_s
        self.metrics = metrics
        self.flights: dict[str, Flight] = {}
        self.raw_timelines: collections.OrderedDict[str, list[tuple[str, str, float]]] = (
            collections.OrderedDict()
        )
        self._final_attempt: dict[str, str] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self._tasks: list[asyncio.Task] = []
        self._hb_tasks: dict[str, asyncio.Task] = {}  # worker endpoint -> its heartbeat reader

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    # ---- life cycle ------------------------------------------------------------------------
    async def start(self, timeout_s: float = 120.0) -> None:
        """Say hello to every worker; raises RuntimeError naming those that never answer."""
        for w in self.workers:
            await w.sock.send(m.encode(m.Hello("router")))
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            while w.info is None:
                left = deadline - time.monotonic()
                if left <= 0 or not await w.sock.poll(int(left * 1000)):
                    raise RuntimeError(f"worker at {w.endpoint} did not answer within {timeout_s}s")
                msg = m.decode(await w.sock.recv())
                if isinstance(msg, m.WorkerInfo):
                    w.info, w.healthy, w.last_seen = msg, True, time.monotonic()
        self._tasks = [asyncio.create_task(self._reader(w)) for w in self.workers]
        self._tasks.append(asyncio.create_task(self._poll_stats()))
        for w in self.workers:
            assert w.info is not None
            if w.info.hb_endpoint:
                self._connect_hb(w, w.info.hb_endpoint)
        self._tasks.append(asyncio.create_task(self._heartbeat()))
        if self.autobalancer is not None:
            self._tasks.append(asyncio.create_task(self._autobalance()))

    async def close(self) -> None:
        tasks = [*self._tasks, *self._hb_tasks.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for w in self.workers:
            w.sock.close(0)
            if w.hb is not None:
                w.hb.close(0)
        if self._owns_ctx:
            self.ctx.term()

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
        if len(self.flights) >= self.max_inflight:
            # Overload is refused at once, before any prefill is spent (issue 6 predicts SLOs).
            self.counters["requests_rejected"] += 1
            if self.metrics is not None:
                self.metrics.on_rejected("overloaded")
            raise RequestError(
                f"{self.max_inflight} requests are in flight; retry shortly",
                429,
                "overloaded",
                retry_after_s=1,
            )
        flight = Flight(rid, list(prompt_ids), params, asyncio.Queue(), session=session)
        flight.timeline.append(("arrive", "router", time.monotonic()))
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
        ends = flight.timeline[0][2] + self.request_timeout_s  # no request outlives this
        while True:
            silence = self._silence_limit(flight)
            left = ends - time.monotonic()
            try:
                item = await asyncio.wait_for(
                    flight.queue.get(), timeout=max(0, min(silence, left))
                )
            except TimeoutError:
                if time.monotonic() >= ends:
                    msg = f"request timed out after {self.request_timeout_s:g}s"
                    raise RequestError(msg, 504, "timeout") from None
                raise RequestError(f"no progress for {silence:g}s", 504, "timeout") from None
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def _silence_limit(self, flight: Flight) -> float:
        """How long a request may go without an event before it fails with 504. A request
        queued behind others legitimately waits its predicted TTFT (heartbeats, not silence,
        tell a dead worker), so before its first token the limit stretches to 3x that."""
        base = max(30.0, 6 * self.deadline_s)
        if flight.first_at is None and flight.prediction is not None:
            return max(base, 3 * flight.prediction.ttft_s)
        return base

    def _end(self, flight: Flight, outcome: str) -> None:
        if not flight.finished:
            self._abort_workers(flight)
        self._release(flight)
        self.flights.pop(flight.rid, None)
        flight.timeline.append(
            ("finish" if outcome == "ok" else outcome, "router", time.monotonic())
        )
        self._keep_timeline(flight)
        self._score_prediction(flight, outcome)
        if outcome == "ok" and flight.session and flight.pair is not None:
            keeper = flight.pair[1] or flight.pair[0]
            self.sessions[flight.session] = (keeper.worker_id, flight.prompt_ids + flight.sent)
            self.sessions.move_to_end(flight.session)
            while len(self.sessions) > TIMELINE_KEEP:
                self.sessions.popitem(last=False)
        self.counters[f"requests_{outcome}"] += 1
        if self.metrics is not None:
            self.metrics.on_request_end(flight, outcome)

    # ---- dispatch --------------------------------------------------------------------------
    def _dispatch(
        self, flight: Flight, only: WorkerState | None = None, admit: bool = False
    ) -> None:
        """Send the request's current attempt to a P/D pair from the pools, or whole to `only`.
        `admit`: the first dispatch, which the planner may refuse (RequestError 429)."""
        flight.p_done, flight.held = False, []  # a new attempt starts from P again
        prompt = flight.prompt_ids + flight.sent  # a retry resumes after what was streamed
        planned = None
        if only is not None:
            flight.pair = (only, None)
        elif self.planner is not None:
            planned = self._plan(flight, prompt, admit)
            flight.pair = planned[0]
        else:
            flight.pair = self._pick()
        for w in flight.pair:
            if w is not None:
                w.outstanding += 1
        params = dict(flight.params.__dict__)
        params["max_tokens"] = flight.params.max_tokens - len(flight.sent)
        first, second = flight.pair
        now = time.monotonic()
        flight.timeline.append(("dispatch", f"attempt {flight.attempt}", now))
        self._note_route(flight, planned[1] if planned else None, only is not None, now)
        if second is None:
            if first.role != "colocated" and only is None and flight.route == "fallback":
                # no healthy worker of the other role: this one runs the whole request
                self.counters["local_fallbacks"] += 1
                flight.timeline.append(("local_fallback", first.worker_id, now))
            self._send(first, m.Generate(flight.wire_rid, prompt, params))
            return
        assert second.info is not None
        self._send(
            second,
            m.ExpectKV(flight.wire_rid, prompt, params, first.worker_id, self.handoff_tokens),
        )
        self._send(
            first,
            m.Prefill(
                flight.wire_rid,
                prompt,
                params,
                second.worker_id,
                second.info.kv_endpoint,
                self.handoff_tokens,
            ),
        )

    def _pools(self) -> dict[str, list[WorkerState]]:
        return {
            role: [w for w in self.workers if w.healthy and not w.draining and w.role == role]
            for role in ("prefill", "decode", "colocated")
        }

    def _plan(
        self, flight: Flight, prompt: list[int], admit: bool
    ) -> tuple[tuple[WorkerState, WorkerState | None], slo.Prediction]:
        """The planner's route for this attempt; refuses (429) a first attempt that would miss."""
        assert self.planner is not None
        pools = self._pools()
        routes = self.planner.routes(
            *([w.worker_id for w in pools[r]] for r in ("prefill", "decode", "colocated"))
        )
        if not routes:
            raise RequestError("no healthy workers to serve the request", 503, "unavailable")
        byid = {w.worker_id: w for pool in pools.values() for w in pool}
        for w in byid.values():
            w.load.worker_id = w.worker_id
        cached = self._cached(prompt, flight.session, byid) if self.prefix_routing else {}
        max_tokens = flight.params.max_tokens - len(flight.sent)
        now = time.monotonic()
        loads = {wid: w.load for wid, w in byid.items()}
        decision = self.planner.decide(
            len(prompt), max_tokens, routes, loads, cached, now, admit_all=not admit
        )
        if decision.chosen is None:
            raise self._reject(flight, decision)
        chosen = decision.chosen
        second = byid[chosen.route.decode] if chosen.route.decode is not None else None
        return (byid[chosen.route.first], second), chosen

    def _reject(self, flight: Flight, decision: slo.Decision) -> RequestError:
        reason = decision.reject or "unavailable"
        self.counters[f"rejected_{reason}"] += 1
        if self.metrics is not None:
            self.metrics.on_refused(reason)
        flight.timeline.append((f"rejected: {reason}", "router", time.monotonic()))
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

    def _cached(
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

    def _note_route(
        self, flight: Flight, pred: slo.Prediction | None, forced: bool, now: float
    ) -> None:
        """Name the attempt's route (timeline, counters) and book its work on the loads."""
        assert flight.pair is not None
        first, second = flight.pair
        if pred is not None:
            kind = pred.route.kind
        elif second is not None:
            kind = "remote"
        elif forced:
            kind = "recompute" if first.role == "decode" else "local"
        else:
            kind = "colocated" if first.role == "colocated" else "fallback"
        flight.route = kind
        self.counters[f"route_{kind}"] += 1
        if self.metrics is not None:
            self.metrics.on_route(kind)
        where = first.worker_id + (f"->{second.worker_id}" if second is not None else "")
        flight.timeline.append((f"route: {kind}", where, now))
        if pred is not None and flight.prediction is None:
            cal = self.planner.calibration if self.planner else slo.Calibration()
            flight.prediction = pred
            flight.raw_pred = (pred.ttft_s / cal.ttft, pred.tpot_s / cal.tpot)
        if self.planner is not None:
            self._book(flight, pred, now)

    def _book(self, flight: Flight, pred: slo.Prediction | None, now: float) -> None:
        assert self.planner is not None and flight.pair is not None
        first, second = flight.pair
        n = len(flight.prompt_ids) + len(flight.sent)
        out = max(1, min(flight.params.max_tokens - len(flight.sent), self.planner.expected_output))
        cached = pred.cached_first if pred is not None else 0
        prefill = self.planner.prefill_time(n, cached, first.load)
        if second is None:
            first.load.add(slo.Job(flight.rid, prefill, n, out, True, now))
            return
        first.load.add(slo.Job(flight.rid, prefill, 0, 0, False, now))
        second.load.add(slo.Job(flight.rid, 0.0, n, out, True, now))

    def _pick(self) -> tuple[WorkerState, WorkerState | None]:
        pools = self._pools()
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

    def _send(self, w: WorkerState, msg: object) -> None:
        # never block the event loop on a dead peer: its queue fills, the message is dropped
        try:
            w.sock.send(m.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.counters["send_dropped"] += 1

    def _release(self, flight: Flight) -> None:
        for w in flight.pair or ():
            if w is not None:
                w.outstanding = max(0, w.outstanding - 1)
                w.load.remove(flight.rid)

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
                self.counters["bad_messages"] += 1
                continue
            self._on_event(w, msg)

    def _on_event(self, w: WorkerState, msg: object) -> None:
        if isinstance(msg, m.WorkerInfo):  # a rejoining worker's (maybe restarted) identity
            old = w.info.hb_endpoint if w.info else ""
            w.info = msg
            if msg.hb_endpoint and msg.hb_endpoint != old:  # restarted: a new heartbeat port
                self._connect_hb(w, msg.hb_endpoint)
            return
        if isinstance(msg, m.KVEvents):
            self.prefix.apply(msg)
            if self.prefix.needs_resync(msg.worker_id):  # a lost message: ask for a snapshot
                self.counters["prefix_resyncs"] += 1
                self._send(w, m.Hello("router"))
            return
        if isinstance(msg, m.Stats):
            w.stats = msg.stats
            if w.hb is None:  # with a heartbeat socket, health is the heartbeat's call
                w.healthy = True
            if self.metrics is not None:
                self.metrics.on_worker_stats(w, msg.stats)
            return
        rid, _, attempt = str(getattr(msg, "rid", "")).rpartition(".")
        flight = self.flights.get(rid)
        if flight is None and isinstance(msg, m.TransferReport):
            self._late_transfer(rid, attempt, msg)
            return
        if flight is None or attempt != str(flight.attempt):
            return  # finished, unknown, or about an earlier attempt
        flight.last_event = time.monotonic()
        if isinstance(msg, m.Tokens):
            self._on_tokens(flight, msg)
        elif isinstance(msg, m.TransferReport):
            self._on_transfer(flight, msg)
        elif isinstance(msg, m.RequestFailed):
            self._on_failed(flight, msg)

    def _late_transfer(self, rid: str, attempt: str, msg: m.TransferReport) -> None:
        """P reports its side after D's ack, which can be after the request finished: still
        part of the request's timeline (and of the transfer counters)."""
        events = self.raw_timelines.get(rid)
        if events is None or self._final_attempt.get(rid) != attempt:
            return
        events += [(f"{msg.side}:{stage}", msg.worker, t) for stage, t in (msg.times or {}).items()]
        events.sort(key=lambda e: e[2])
        self.counters[f"kv_{msg.side}_bytes"] += msg.nbytes
        self.counters[f"kv_{msg.side}_frames"] += msg.frames
        if self.metrics is not None:
            self.metrics.on_transfer(msg)

    def _on_tokens(self, flight: Flight, msg: m.Tokens) -> None:
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
        if msg.token_ids:
            flight.first_at = flight.first_at or now
            flight.last_at = now
            for w in flight.pair or ():
                if w is not None:
                    w.load.first_token(flight.rid, now)
                    w.load.tokens(flight.rid, len(msg.token_ids), now)
        seen = {w for e, w, _ in flight.timeline if e == "first_token"}
        if msg.token_ids and msg.worker not in seen:  # each worker's first tokens: P's, then D's
            flight.timeline.append(("first_token", msg.worker, msg.time))
        colocated = flight.pair is not None and flight.pair[1] is None
        for stage, t in (msg.times or {}).items() if colocated else ():
            # A whole request on one worker: its own prefill stages (P and D report theirs in
            # TransferReport instead).
            flight.timeline.append((f"local:{stage}", msg.worker, t))
        flight.sent += msg.token_ids
        finish = msg.finish_reason if msg.finished else None
        flight.queue.put_nowait(
            Delta(msg.token_ids, msg.text, msg.logprobs, finish, msg.stop_reason)
        )
        if msg.finished:
            flight.finished = True
            first, second = flight.pair or (None, None)
            if second is not None and first is not None and msg.worker == first.worker_id:
                self._send(second, m.Abort(flight.wire_rid))  # done on P: free D's reservation

    def _on_transfer(self, flight: Flight, msg: m.TransferReport) -> None:
        if self.planner is not None and msg.side == "recv" and msg.nbytes > 0:
            # learn KV bytes per token (codec, dtype) for the planner's transfer times
            cached = flight.prediction.cached_decode if flight.prediction else 0
            tokens = max(1, len(flight.prompt_ids) - cached)
            per = msg.nbytes / tokens
            old = self.planner.kv_bytes_per_token
            self.planner.kv_bytes_per_token = per if old <= 0 else 0.8 * old + 0.2 * per
        for stage, t in (msg.times or {}).items():
            flight.timeline.append((f"{msg.side}:{stage}", msg.worker, t))
        self.counters[f"kv_{msg.side}_bytes"] += msg.nbytes
        self.counters[f"kv_{msg.side}_frames"] += msg.frames
        if self.metrics is not None:
            self.metrics.on_transfer(msg)

    def _on_failed(self, flight: Flight, msg: m.RequestFailed) -> None:
        self._abort_workers(flight)
        self._release(flight)
        flight.timeline.append((f"failed: {msg.reason}", msg.worker, time.monotonic()))
        if msg.stage == "transfer" and flight.attempt <= self.max_retries:
            self.counters["retries"] += 1
            if self.metrics is not None:
                self.metrics.on_retry(msg)
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
            self.counters["recomputes"] += 1
            if self.metrics is not None:
                self.metrics.on_recompute()
            flight.attempt += 1
            flight.timeline.append(("recompute", decode.worker_id, time.monotonic()))
            self._dispatch(flight, only=decode)
            return
        status = 400 if msg.stage == "admission" else 503
        code = "invalid_request" if status == 400 else "worker_error"
        flight.queue.put_nowait(RequestError(msg.reason, status, code))

    # ---- stats, health, introspection ------------------------------------------------------
    async def _poll_stats(self) -> None:
        while True:
            now = time.monotonic()
            for w in self.workers:
                silent = now - w.last_seen > 3 * self.stats_interval_s + self.deadline_s
                if w.hb is None and silent:
                    w.healthy = False  # no heartbeat socket: judged by its stats replies
                self._send(w, m.GetStats())
            await asyncio.sleep(self.stats_interval_s)

    # ---- liveness and recovery -------------------------------------------------------------
    def _connect_hb(self, w: WorkerState, endpoint: str) -> None:
        old = self._hb_tasks.pop(w.endpoint, None)
        if old is not None:
            old.cancel()
        if w.hb is not None:
            w.hb.close(0)
        w.hb, w.last_pong = self._socket(endpoint), time.monotonic()
        self._hb_tasks[w.endpoint] = asyncio.create_task(self._hb_reader(w))

    async def _heartbeat(self) -> None:
        seq, last_round = 0, time.monotonic()
        while True:
            seq += 1
            now = time.monotonic()
            # If this loop itself was held up (a blocking call on the event loop), the pongs
            # could not be read either: judge no one this round.
            stalled = now - last_round > self.liveness_timeout_s / 2
            last_round = now
            for w in self.workers:
                if not w.healthy and seq % 2 == 0:
                    # a restarted worker answers Hello with its new heartbeat address
                    self._send(w, m.Hello("router"))
                if w.hb is None:
                    continue
                with contextlib.suppress(zmq.Again):
                    w.hb.send(m.encode(m.Ping(seq)), zmq.NOBLOCK)
                if not w.healthy or stalled:
                    if stalled:
                        w.last_pong = max(w.last_pong, now - self.heartbeat_interval_s)
                    continue
                if now - w.last_pong > self.liveness_timeout_s:
                    self.worker_down(w, "no_heartbeat")
                elif w.loop_age > self.stuck_timeout_s:
                    self.worker_down(w, "stuck")
            await asyncio.sleep(self.heartbeat_interval_s)

    async def _hb_reader(self, w: WorkerState) -> None:
        assert w.hb is not None
        while True:
            raw = await w.hb.recv()
            try:
                pong = m.decode(raw)
            except m.MessageError:
                self.counters["bad_messages"] += 1
                continue
            if not isinstance(pong, m.Pong):
                continue
            w.last_pong, w.loop_age = time.monotonic(), pong.loop_age_s
            if w.down_reason is not None and pong.loop_age_s <= self.stuck_timeout_s:
                self._worker_up(w)

    def _worker_up(self, w: WorkerState) -> None:
        self.counters["workers_up"] += 1
        w.down_reason, w.healthy, w.last_seen = None, True, time.monotonic()
        w.outstanding = 0  # its requests were all recovered elsewhere
        self._send(w, m.Hello("router"))  # learn its identity again: it may have restarted

    def worker_down(self, w: WorkerState, reason: str) -> None:
        """Take `w` out of routing and recover every request it was part of."""
        w.healthy, w.down_reason = False, reason
        self.prefix.drop(w.worker_id)  # a restarted worker's cache is empty; it re-sends
        self.counters["workers_down"] += 1
        if self.metrics is not None:
            self.metrics.on_worker_down(w, reason)
        for flight in list(self.flights.values()):
            if flight.pair is not None and w in flight.pair and not flight.finished:
                self._recover(flight, w, reason)

    def _recover(self, flight: Flight, dead: WorkerState, reason: str) -> None:
        flight.timeline.append((f"worker_down: {reason}", dead.worker_id, time.monotonic()))
        self._abort_workers(flight)  # the survivor frees its part; the dead one's is moot
        self._release(flight)
        if flight.recoveries >= self.max_recoveries:
            msg = f"worker {dead.worker_id} went down ({reason}); no recoveries left"
            flight.queue.put_nowait(RequestError(msg, 503, "worker_error"))
            return
        flight.recoveries += 1
        flight.attempt += 1
        self.counters["recoveries"] += 1
        try:
            self._dispatch(flight)
        except RequestError as e:
            flight.queue.put_nowait(e)
            return
        first, second = flight.pair or (dead, None)
        how = "pair" if second is not None else first.role
        how = "local" if how in ("prefill", "decode") else how
        if self.metrics is not None:
            self.metrics.on_recovery(how)

    # ---- role switching -------------------------------------------------------------------
    async def set_role(
        self, worker_id: str, role: str, by: str = "admin", timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Drain `worker_id` (no new requests; those it holds finish), switch its role, and let
        it rejoin routing. Raises RequestError: 404 unknown, 409 busy/unhealthy/not drained."""
        w = next((x for x in self.workers if x.worker_id == worker_id), None)
        if w is None:
            raise RequestError(f"no worker {worker_id!r}", 404, "not_found")
        if role not in ("prefill", "decode", "colocated"):
            raise RequestError(f"unknown role {role!r}", 400, "invalid_value")
        if w.role != role:
            if w.draining or not w.healthy:
                why = "is already switching" if w.draining else "is not healthy"
                raise RequestError(f"worker {worker_id} {why}", 409, "conflict")
            w.draining = True
            try:
                await self._drain_worker(w, timeout_s or self.request_timeout_s)
                await self._switch(w, role)
            finally:
                w.draining = False
            self.counters[f"role_switches_{by}"] += 1
            if self.metrics is not None:
                self.metrics.on_role_switch(by)
        return next(r for r in self.worker_table() if r["id"] == worker_id)

    async def _drain_worker(self, w: WorkerState, timeout_s: float) -> None:
        ends = time.monotonic() + timeout_s
        while any(f.pair is not None and w in f.pair for f in self.flights.values()) or (
            w.stats.get("transfers_out", 0) or w.stats.get("transfers_in", 0)
        ):
            if time.monotonic() > ends:
                msg = f"worker {w.worker_id} did not drain within {timeout_s:g}s"
                raise RequestError(msg, 409, "conflict")
            if not w.healthy:
                raise RequestError(
                    f"worker {w.worker_id} went down while draining", 409, "conflict"
                )
            await asyncio.sleep(0.05)

    async def _switch(self, w: WorkerState, role: str) -> None:
        self._send(w, m.SetRole(role))  # answered with WorkerInfo, which _on_event stores
        ends = time.monotonic() + max(5.0, self.deadline_s)
        while w.role != role:
            if time.monotonic() > ends:
                raise RequestError(f"worker {w.worker_id} did not switch roles", 409, "conflict")
            await asyncio.sleep(0.02)

    def pool_sample(self, now: float) -> balancer.PoolSample:
        """The autobalancer's view of the pools (an empty pool's work runs on the other)."""
        assert self.planner is not None
        pools = self._pools()
        everyone = pools["prefill"] + pools["decode"]
        return balancer.pressures(
            [w.load for w in pools["prefill"] or everyone],
            [w.load for w in pools["decode"] or everyone],
            self.planner,
            now,
            len(pools["prefill"]),
            len(pools["decode"]),
        )

    async def _autobalance(self) -> None:
        assert self.autobalancer is not None
        while True:
            await asyncio.sleep(self.autobalance_interval_s)
            now = time.monotonic()
            if any(w.draining for w in self.workers):
                continue
            move = self.autobalancer.observe(now, self.pool_sample(now))
            if move is None:
                continue
            src, dst = ("decode", "prefill") if move == "to_prefill" else ("prefill", "decode")
            pool = self._pools()[src]
            if not pool:
                continue
            w = min(pool, key=lambda x: (x.outstanding, x.worker_id))  # the quickest to drain
            self.counters[f"autobalance_{move}"] += 1
            with contextlib.suppress(RequestError):
                await self.set_role(w.worker_id, dst, by="autobalance")

    def worker_table(self) -> list[dict[str, Any]]:
        rows = []
        for w in self.workers:
            s = w.stats
            rows.append(
                {
                    "id": w.worker_id,
                    "role": w.role,
                    "url": w.endpoint,
                    "pid": w.info.pid if w.info else None,
                    "healthy": w.healthy,
                    "draining": w.draining,
                    "down_reason": w.down_reason,
                    "loop_age_s": round(w.loop_age, 3),
                    "queue": s.get("waiting", 0),
                    "running": s.get("running", 0),
                    "outstanding": w.outstanding,
                    "kv_blocks_used": s.get("kv_blocks_used", 0),
                    "kv_blocks_total": s.get("kv_blocks_total", 0),
                    "quantization": s.get("quantization"),
                }
            )
        return rows

    def _score_prediction(self, flight: Flight, outcome: str) -> None:
        """Predicted vs actual TTFT/TPOT: kept for the timeline, fed to the metric of
        prediction error and to the planner's online calibration."""
        pred = flight.prediction
        if pred is None:
            return
        arrive = flight.timeline[0][2]
        ttft = flight.first_at - arrive if flight.first_at is not None else None
        n = len(flight.sent)
        tpot = None
        if outcome == "ok" and n > 1 and flight.first_at is not None and flight.last_at:
            tpot = (flight.last_at - flight.first_at) / (n - 1)
        self.predictions[flight.rid] = {
            "route": pred.route.kind,
            "workers": [w for w in (pred.route.first, pred.route.decode) if w],
            "ttft_s": round(pred.ttft_s, 6),
            "tpot_s": round(pred.tpot_s, 6),
            "cached_prefill_tokens": pred.cached_first,
            "cached_decode_tokens": pred.cached_decode,
            "actual_ttft_s": None if ttft is None else round(ttft, 6),
            "actual_tpot_s": None if tpot is None else round(tpot, 6),
        }
        for kind, predicted, actual, raw in (
            ("ttft", pred.ttft_s, ttft, flight.raw_pred[0]),
            ("tpot", pred.tpot_s, tpot, flight.raw_pred[1]),
        ):
            if actual is None or actual <= 0:
                continue
            if self.metrics is not None:
                self.metrics.on_prediction(kind, abs(predicted - actual) / actual)
            if self.planner is not None and flight.attempt == 1:
                self.planner.calibration.observe(kind, raw, actual)

    def prediction(self, rid: str) -> dict[str, Any] | None:
        return self.predictions.get(rid)

    def _keep_timeline(self, flight: Flight) -> None:
        self.raw_timelines[flight.rid] = sorted(flight.timeline, key=lambda e: e[2])
        self._final_attempt[flight.rid] = str(flight.attempt)
        while len(self.raw_timelines) > TIMELINE_KEEP:
            old, _ = self.raw_timelines.popitem(last=False)
            self._final_attempt.pop(old, None)
            self.predictions.pop(old, None)

    def raw_timeline(self, rid: str) -> list[tuple[str, str, float]] | None:
        """(event, worker, time.monotonic()) with the workers' own stage names."""
        flight = self.flights.get(rid)
        if flight is not None:
            return sorted(flight.timeline, key=lambda e: e[2])
        return self.raw_timelines.get(rid)

    def timeline(self, rid: str) -> list[dict[str, Any]] | None:
        """The request's events for people: known stages under their public names (queue,
        prefill_start/end, transfer_start/end, decode_first_token), times in ms from arrival."""
        events = self.raw_timeline(rid)
        if events is None:
            return None
        t0, out, first_by = events[0][2], [], None
        for event, worker, t in events:
            name = _STAGES.get(event, event)
            if event == "first_token":
                first_by = first_by or worker
                name = "first_token" if worker == first_by else "decode_first_token"
            out.append({"event": name, "worker": worker, "t_ms": round((t - t0) * 1000, 3)})
        return out
