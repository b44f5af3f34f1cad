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
from pdserve.router.policies import WorkerLoad, make_policy
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
    ) -> None:
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
        self, rid: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[Delta]:
        """Stream a request's deltas; raises RequestError; cancelling it aborts everywhere."""
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
        flight = Flight(rid, list(prompt_ids), params, asyncio.Queue())
        flight.timeline.append(("arrive", "router", time.monotonic()))
        self.flights[rid] = flight
        outcome = "error"
        try:
            self._dispatch(flight)
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
        silence = max(30.0, 6 * self.deadline_s)
        ends = flight.timeline[0][2] + self.request_timeout_s  # no request outlives this
        while True:
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

    def _end(self, flight: Flight, outcome: str) -> None:
        if not flight.finished:
            self._abort_workers(flight)
        self._release(flight)
        self.flights.pop(flight.rid, None)
        flight.timeline.append(
            ("finish" if outcome == "ok" else outcome, "router", time.monotonic())
        )
        self._keep_timeline(flight)
        self.counters[f"requests_{outcome}"] += 1
        if self.metrics is not None:
            self.metrics.on_request_end(flight, outcome)

    # ---- dispatch --------------------------------------------------------------------------
    def _dispatch(self, flight: Flight, only: WorkerState | None = None) -> None:
        """Send the request's current attempt to a P/D pair from the pools, or whole to `only`."""
        flight.p_done, flight.held = False, []  # a new attempt starts from P again
        flight.pair = (only, None) if only is not None else self._pick()
        for w in flight.pair:
            if w is not None:
                w.outstanding += 1
        prompt = flight.prompt_ids + flight.sent  # a retry resumes after what was streamed
        params = dict(flight.params.__dict__)
        params["max_tokens"] = flight.params.max_tokens - len(flight.sent)
        first, second = flight.pair
        flight.timeline.append(("dispatch", f"attempt {flight.attempt}", time.monotonic()))
        if second is None:
            if first.role != "colocated" and only is None:
                # no healthy worker of the other role: this one runs the whole request
                self.counters["local_fallbacks"] += 1
                flight.timeline.append(("local_fallback", first.worker_id, time.monotonic()))
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

    def _pick(self) -> tuple[WorkerState, WorkerState | None]:
        pools = {
            role: [w for w in self.workers if w.healthy and w.role == role]
            for role in ("prefill", "decode", "colocated")
        }
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
                    "down_reason": w.down_reason,
                    "loop_age_s": round(w.loop_age, 3),
                    "queue": s.get("waiting", 0),
                    "running": s.get("running", 0),
                    "outstanding": w.outstanding,
                    "kv_blocks_used": s.get("kv_blocks_used", 0),
                    "kv_blocks_total": s.get("kv_blocks_total", 0),
                }
            )
        return rows

    def _keep_timeline(self, flight: Flight) -> None:
        self.raw_timelines[flight.rid] = sorted(flight.timeline, key=lambda e: e[2])
        self._final_attempt[flight.rid] = str(flight.attempt)
        while len(self.raw_timelines) > TIMELINE_KEEP:
            old, _ = self.raw_timelines.popitem(last=False)
            self._final_attempt.pop(old, None)

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
