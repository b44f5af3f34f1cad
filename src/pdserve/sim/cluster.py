"""The discrete-event simulation of a deployment: router, P / D / colocated workers, KV links.

Only time is simulated. Every decision is the real code's:
  * each worker is the engine's `Scheduler` over a `KVCacheManager` (block ids only: the
    simulator has no tensors, so the manager *is* the fake block store); `schedule()` decides
    every step, `update_from_output` advances it; preemption, chunking, prefix caching, held KV
    and reservations are the engine's own;
  * the router is `SloPlanner.routes/decide` (admission, conditional disaggregation, and its
    online calibration: `SloPlanner.learn` from each finished request, as `router/timeline.py`
    calls it) over `WorkerLoad`s booked exactly as `router/routing.py` books them,
    `PrefixIndex` fed with the workers' real `KVEvents`, the routing policies of
    `router/policies.py` when there is no planner, and `balancer.pressures` + `Autobalancer`
    for role moves.

Life of a request, by the handlers below:
  1. `_arrive`      the router decides: reject (admission), or a route and its workers;
  2. `_dispatch`    remote: D reserves KV (`reserve_with_prefix`, retried after each of D's steps
                    while memory is short) and P adds the prompt (max_tokens = 1, hold_kv);
                    local / colocated: the worker adds the whole request;
  3. `_step_done`   a worker's step ends after `StepModel.step_s(rows)`: tokens sampled go to
                    the router (first token = TTFT), KV computed for a remote request streams
                    over P's link layer by layer (`Link.stream`);
  4. `_kv_done`     the last KV byte + the per-message cost: D registers the KV on its own
                    loop (`StepModel.receive_s`, between its steps, before the next one), then
                    admits the request with num_computed_tokens = prompt
                    (`Scheduler.add_prefilled`); P frees its held blocks (KVAck);
  5. `_finish`      the request's last token: the router releases its loads.

The event loop is a heap of (time, sequence number, callback): ties run in the order scheduled.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.costmodel.contention import Contention
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerOutput, SchedulerPolicy

__all__ = ["Record", "SimConfig", "SimRequest", "SimWorker", "Simulation"]
from pdserve.router import balancer, slo
from pdserve.router.policies import WorkerLoad as PolicyLoad
from pdserve.router.policies import make_policy
from pdserve.router.prefix_index import PrefixIndex
from pdserve.sim.host import Host, step_kind
from pdserve.sim.records import Record, SimConfig, SimRequest
from pdserve.sim.steptime import Link, Row, StepModel, instance_kv_blocks
from pdserve.workers.messages import KVEvents

TOKEN = 7  # every sampled token (never an eos: requests stop at max_tokens, ignore_eos)
ROLES = ("prefill", "decode", "colocated")


@dataclass
class _Outgoing:
    """P's side of one hand-off: KV computed, streamed once D has reserved."""

    rid: str
    dest: SimWorker
    reserved_at: float | None = None
    have_tokens: int = 0  # D's cached prefix: not sent
    chunks: list[tuple[int, int, float, float]] = field(default_factory=list)  # unsent
    sent_until: float = 0.0
    prefill_done: bool = False
    nbytes: int = 0
    tokens: int = 0  # KV tokens sent (D's receive work)


class SimWorker:
    """One engine instance: the real scheduler, stepping in simulated time."""

    def __init__(
        self, sim: Simulation, wid: str, role: str, step: StepModel, policy: SchedulerPolicy
    ) -> None:
        self.sim, self.wid, self.role, self.step = sim, wid, role, step
        cfg = sim.config
        self.kv = KVCacheManager(instance_kv_blocks(step, cfg.block_size), cfg.block_size,
                                 enable_prefix_caching=cfg.prefix_caching)  # fmt: skip
        self.sched = Scheduler(policy, self.kv)
        self.load = slo.WorkerLoad(wid)
        self.outstanding = 0
        self.link = Link(sim.link.bytes_s * step.gpus, sim.link.per_message_s)
        self.busy = False
        self.draining = False
        self.reserving: deque[Request] = deque()  # ExpectKV waiting for blocks
        self.reserved: dict[str, tuple[Request, float]] = {}
        self.receiving: deque[tuple[str, float]] = deque()  # KV in, D's receive work owed
        self.outgoing: dict[str, _Outgoing] = {}
        self.busy_s = 0.0
        self.steps = 0
        self.kv_seq = 0
        self.log: list[tuple[float, str, str]] = []  # (time, what, rid): scheduling decisions

    # ---- intake ------------------------------------------------------------------------------
    def generate(self, req: SimRequest) -> None:
        self.sched.add_request(self._request(req, req.max_tokens))
        self.kick()

    def prefill(self, req: SimRequest, dest: SimWorker) -> None:
        request = self._request(req, 1)
        request.hold_kv = True
        self.outgoing[req.rid] = _Outgoing(req.rid, dest)
        self.sched.add_request(request)
        self.kick()

    def expect(self, req: SimRequest) -> None:
        """ExpectKV: reserve blocks for the prompt's KV (as `LLMEngine.reserve_kv`)."""
        request = self._request(req, req.max_tokens)
        self.sched.check_fits(request)
        self.reserving.append(request)
        self._try_reserve()

    def _request(self, req: SimRequest, max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return Request(req.rid, list(req.prompt), params, arrival_time=req.arrival)

    def _try_reserve(self) -> None:
        while self.reserving:
            request = self.reserving[0]
            n_kv = request.num_prompt_tokens
            got = self.kv.reserve_with_prefix(request, n_kv + 1, n_kv - 1)
            if got is None:
                return  # retried after the next step frees blocks
            self.reserving.popleft()
            self.reserved[request.request_id] = (request, self.sim.now)
            self.log.append((self.sim.now, "reserve", request.request_id))
            self.sim.on_reserved(self, request.request_id, got[1])

    def received(self, rid: str, tokens: int) -> None:
        """Every KV byte is here: D's loop registers it (decode + copy per frame) before its
        next step, as `workers/decode.py` does between `engine.step()` calls, then admits."""
        work = self.step.receive_s(tokens)
        if work <= 0:
            self.admit(rid)
            return
        self.receiving.append((rid, work))
        self.kick()

    def admit(self, rid: str) -> None:
        """KVDone: every KV byte is here; the request decodes (`add_prefilled`)."""
        request, _ = self.reserved.pop(rid)
        request.output_token_ids = [TOKEN]
        request.num_computed_tokens = request.num_prompt_tokens
        if request.num_tokens >= request.num_prompt_tokens + request.sampling_params.max_tokens:
            self.kv.free(rid)  # the first token was the last: nothing to decode
            self.sim.on_finished(self, rid)
            return
        self.sched.add_prefilled(request)
        self.log.append((self.sim.now, "admit", rid))
        self.kick()

    def cancel(self, rid: str) -> None:
        for request in list(self.reserving):
            if request.request_id == rid:
                self.reserving.remove(request)
        if self.reserved.pop(rid, None) is not None:
            self.kv.free(rid)

    def release(self, rid: str) -> None:
        """KVAck: P frees the blocks it held for the transfer."""
        self.sched.release_held(rid)
        self.kick()

    # ---- steps ---------------------------------------------------------------------------
    def kick(self) -> None:
        if self.busy:
            return
        if self.receiving:  # hand-offs received during the last step come first
            rid, work = self.receiving.popleft()
            self.busy, t0 = True, self.sim.now
            # memory copies: on a shared host, slowed as a decode step (the nearer kind)
            self.sim.run_step(self.wid, [], work, lambda: self._received(rid, t0), "decode")
            return
        out = self.sched.schedule()
        for _ in range(len(self.sched.running) + 1):
            # a step that only preempted (a request preempting itself) changed the queues:
            # the worker loop would schedule again at once
            for rid in out.preempted:
                self.log.append((self.sim.now, "preempt", rid))
            if not (out.is_empty and out.preempted):
                break
            out = self.sched.schedule()
        if out.is_empty:
            return
        rows = [(s.num_tokens, s.start_pos) for s in out.scheduled]
        for s in out.scheduled:
            if s.start_pos == 0 or s.num_tokens > 1:
                self.log.append((self.sim.now, "prefill", s.request_id))
        self.busy, t0 = True, self.sim.now
        self.steps += 1
        self.sim.run_step(self.wid, rows, self.step.step_s(rows), lambda: self._step_done(out, t0))

    def _received(self, rid: str, t0: float) -> None:
        self.busy = False
        self.busy_s += self.sim.now - t0
        self.admit(rid)  # kicks the next step (or the next receive)
        self.kick()

    def _step_done(self, out: SchedulerOutput, t0: float) -> None:
        self.busy, dur = False, self.sim.now - t0  # longer than step_s when the host is shared
        self.busy_s += dur
        for s in out.scheduled:
            o = self.outgoing.get(s.request_id)
            if o is not None:
                o.chunks.append((s.start_pos, s.num_tokens, t0, dur))
        sampled = {s.request_id: TOKEN for s in out.scheduled if s.sample}
        finished = {r.request_id for r in self.sched.update_from_output(out, sampled)}
        for rid in sampled:
            o = self.outgoing.get(rid)
            if o is not None:
                o.prefill_done = True
                self.sim.on_token(self, rid, finished=False)
                self._flush(o)
            else:
                self.sim.on_token(self, rid, finished=rid in finished)
        self._publish_kv_events()
        self._try_reserve()
        self.kick()

    # ---- KV transfer (P side) ----------------------------------------------------------
    def on_reserved(self, rid: str, at: float, have_tokens: int) -> None:
        o = self.outgoing.get(rid)
        if o is None:
            return
        o.reserved_at, o.have_tokens = at, have_tokens
        self._flush(o)

    def _flush(self, o: _Outgoing) -> None:
        """Send the chunks computed so far (once D has reserved); hand off when all are sent."""
        if o.reserved_at is None:
            return
        bpt = self.step.kv_bytes_per_token
        for start, n, t0, dur in o.chunks:
            tokens = max(0, start + n - max(start, o.have_tokens))
            nbytes = tokens * bpt
            o.nbytes += int(nbytes)
            o.tokens += tokens
            done = self.link.stream(t0, dur, nbytes, self.step.layers, o.reserved_at)
            o.sent_until = max(o.sent_until, done)
        o.chunks.clear()
        if o.prefill_done:
            del self.outgoing[o.rid]
            at = max(o.sent_until, self.sim.now) + self.link.per_message_s
            self.sim.at(at, lambda: self.sim.on_kv_done(self, o))

    def _publish_kv_events(self) -> None:
        if not self.sim.config.prefix_routing or not self.kv.has_events:
            return
        stored, removed, cleared = self.kv.take_events()
        seq, self.kv_seq = self.kv_seq, self.kv_seq + 1
        cleared = cleared or seq == 0
        if cleared and seq == 0 and not stored:
            stored = self.kv.cached_hashes()
        ev = KVEvents(self.wid, seq, self.kv.block_size, stored, removed, cleared)
        self.sim.at(self.sim.now + self.sim.config.message_s, lambda: self.sim.prefix.apply(ev))

    def cached_tokens(self, rid: str) -> int:
        request = self.sched.requests.get(rid) or self.sched.held.get(rid)
        return request.num_cached_tokens if request is not None else 0

    @property
    def idle(self) -> bool:
        return not (
            self.sched.has_unfinished()
            or self.sched.held
            or self.reserved
            or self.reserving
            or self.receiving
            or self.outgoing
        )


class Simulation:
    def __init__(
        self,
        config: SimConfig,
        step: StepModel,
        link: Link,
        planner_model: slo.CostModel | None = None,
        prefill_step: StepModel | None = None,
        contention: Contention | None = None,  # the workers share one CPU host (sim/host.py)
        calibration: slo.Calibration | None = None,  # the planner's, learned before the run
    ) -> None:
        self.config, self.link = config, link
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.host = None if contention is None else Host(contention, self.at, lambda: self.now)
        self.workers: list[SimWorker] = []
        p_policy = config.prefill_policy or config.policy
        for role, n, model, pol in (
            ("prefill", config.prefill, prefill_step or step, p_policy),
            ("decode", config.decode, step, config.policy),
            ("colocated", config.colocated, step, config.policy),
        ):
            for i in range(n):
                self.workers.append(SimWorker(self, f"{role[0].upper()}{i}", role, model, pol))
        self.byid = {w.wid: w for w in self.workers}
        self.prefix = PrefixIndex()
        self.planner: slo.SloPlanner | None = None
        if config.planner:
            if planner_model is None:
                raise ValueError("the planner needs a cost model")
            self.planner = slo.SloPlanner(
                planner_model,
                slo_ttft_s=config.slo_ttft_s,
                slo_tpot_s=config.slo_tpot_s,
                admission=config.admission,
                mode=config.disaggregation,
                token_budget=config.policy.max_num_batched_tokens,
                expected_output=config.expected_output,
                kv_bytes_per_token=step.kv_bytes_per_token,
            )
            if calibration is not None:
                self.planner.calibration = calibration
        self.policies = {r: make_policy(config.router_policy) for r in ROLES}
        self.autobalancer = balancer.Autobalancer() if config.autobalance else None
        self.records: dict[str, Record] = {}
        self.routes: dict[str, tuple[SimWorker, SimWorker | None]] = {}
        self.counters: dict[str, int] = {}
        self._next_turn: dict[int, deque[SimRequest]] = {}
        self._conv: dict[str, int] = {}
        self._target: dict[str, str] = {}  # draining worker -> its next role
        self.decisions: list[tuple[float, str, str, str]] = []  # (time, rid, route, workers)
        self._raw: dict[str, tuple[float, float]] = {}  # uncalibrated predictions, to learn from

    # ---- the loop ----------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run(self, requests: Sequence[SimRequest], until: float = float("inf")) -> list[Record]:
        seen: set[int] = set()
        for req in sorted(requests, key=lambda r: r.arrival):
            if req.rid in self.records:
                raise ValueError(f"duplicate request id {req.rid!r}")
            self.records[req.rid] = Record(req.rid, len(req.prompt), req.max_tokens, req.phase)
            if req.conversation >= 0:
                self._conv[req.rid] = req.conversation
            if req.conversation >= 0 and req.conversation in seen:
                self._next_turn.setdefault(req.conversation, deque()).append(req)
                continue
            seen.add(req.conversation)
            self.at(req.arrival, lambda r=req: self._arrive(r))  # type: ignore[misc]
        if self.autobalancer is not None:
            self.at(1.0, self._balance)
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            if t > until:
                break
            self.now = t
            fn()
        return [self.records[r.rid] for r in requests]

    def run_step(
        self, wid: str, rows: list[Row], work: float, done: Callable[[], None], kind: str = ""
    ) -> None:
        """A step of `work` s alone; on a shared host, stretched while others are mid-step."""
        if self.host is None:
            self.at(self.now + work, done)
        else:
            self.host.start(self.now, wid, kind or step_kind(rows), work, done)

    def count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    # ---- the router ------------------------------------------------------------------------
    def _pools(self) -> dict[str, list[SimWorker]]:
        return {r: [w for w in self.workers if w.role == r and not w.draining] for r in ROLES}

    def _arrive(self, req: SimRequest) -> None:
        rec = self.records[req.rid]
        rec.arrival = self.now
        pair, pred = self._route(req)
        if pair is None:
            rec.rejected = pred.reject if isinstance(pred, slo.Decision) else "unavailable"
            self.count(f"rejected_{rec.rejected}")
            if req.conversation >= 0:  # the conversation's next turn
                self._next_by_conv(req.conversation)
            return
        first, second = pair
        chosen = pred.chosen if isinstance(pred, slo.Decision) else None
        kind = chosen.route.kind if chosen else ("remote" if second else "colocated")
        rec.route, rec.workers = kind, tuple(w.wid for w in pair if w is not None)
        if chosen is not None:
            rec.predicted_ttft, rec.predicted_tpot = chosen.ttft_s, chosen.tpot_s
            if self.planner is not None:
                self._raw[req.rid] = self.planner.uncalibrated(chosen)
        self.count(f"route_{kind}")
        self.decisions.append((self.now, req.rid, kind, "->".join(rec.workers)))
        self.routes[req.rid] = pair
        for w in pair:
            if w is not None:
                w.outstanding += 1
        if self.planner is not None:
            self._book(req, pair, chosen)
        self.at(self.now + self.config.message_s, lambda: self._dispatch(req, first, second))

    def _route(
        self, req: SimRequest
    ) -> tuple[tuple[SimWorker, SimWorker | None] | None, slo.Decision | None]:
        """As router/routing.py: `plan` (with a planner) or `pick` (without)."""
        pools = self._pools()
        if self.planner is None:
            if pools["prefill"] and pools["decode"]:
                return (self._choose(pools["prefill"]), self._choose(pools["decode"])), None
            pool = pools["colocated"] or pools["decode"] or pools["prefill"]
            return ((self._choose(pool), None), None) if pool else (None, None)
        routes = self.planner.routes(*([w.wid for w in pools[r]] for r in ROLES))
        byid = {w.wid: w for pool in pools.values() for w in pool}
        cached: dict[str, int] = {}
        if self.config.prefix_routing:
            cached = self.prefix.match(req.prompt, self.config.block_size, list(byid))
        loads = {wid: w.load for wid, w in byid.items()}
        decision = self.planner.decide(
            len(req.prompt), req.max_tokens, routes, loads, cached, self.now
        )
        if decision.chosen is None:
            return None, decision
        route = decision.chosen.route
        second = byid[route.decode] if route.decode is not None else None
        return (byid[route.first], second), decision

    def _choose(self, pool: list[SimWorker]) -> SimWorker:
        loads = [PolicyLoad(w.wid, w.outstanding, w.sched.num_waiting) for w in pool]
        chosen = self.policies[pool[0].role].pick(loads)
        return self.byid[chosen.worker_id]

    def _book(
        self,
        req: SimRequest,
        pair: tuple[SimWorker, SimWorker | None],
        pred: slo.Prediction | None,
    ) -> None:
        """As routing._book: the work this request puts on its workers' loads."""
        assert self.planner is not None
        first, second = pair
        n = len(req.prompt)
        out = max(1, min(req.max_tokens, self.planner.expected_output))
        cached = pred.cached_first if pred is not None else 0
        prefill = self.planner.prefill_time(n, cached, first.load)
        if second is None:
            first.load.add(slo.Job(req.rid, prefill, n, out, True, self.now))
            return
        first.load.add(slo.Job(req.rid, prefill, 0, 0, False, self.now))
        second.load.add(slo.Job(req.rid, 0.0, n, out, True, self.now))

    def _dispatch(self, req: SimRequest, first: SimWorker, second: SimWorker | None) -> None:
        if second is None:
            first.generate(req)
            return
        second.expect(req)
        if req.rid in self.routes:  # (reserving may have finished a 1-token request)
            first.prefill(req, second)

    # ---- events from workers -----------------------------------------------------------------
    def on_reserved(self, dest: SimWorker, rid: str, have_tokens: int) -> None:
        pair = self.routes.get(rid)
        if pair is None:
            return
        t = self.now + self.config.message_s  # KVReady
        self.at(t, lambda: pair[0].on_reserved(rid, t, have_tokens))

    def on_token(self, w: SimWorker, rid: str, finished: bool) -> None:
        def deliver() -> None:
            rec = self.records[rid]
            now = self.now
            if rec.first_at is None:
                rec.first_at = now
                rec.cached_tokens = w.cached_tokens(rid)
            rec.last_at = now
            rec.tokens += 1
            for x in self.routes.get(rid, ()) if self.planner is not None else ():
                if x is not None:
                    x.load.first_token(rid, now)
                    x.load.tokens(rid, 1, now)
            if finished:
                self.on_finished(w, rid)

        if self.config.message_s:
            self.at(self.now + self.config.message_s, deliver)
        else:
            deliver()

    def on_kv_done(self, p: SimWorker, o: _Outgoing) -> None:
        rec = self.records[o.rid]
        rec.kv_bytes += o.nbytes
        self.count("kv_transfers")
        o.dest.received(o.rid, o.tokens)
        self.at(self.now + self.config.message_s, lambda: p.release(o.rid))  # KVAck

    def on_finished(self, w: SimWorker, rid: str) -> None:
        rec = self.records[rid]
        if rec.finished_at is not None:
            return
        rec.finished_at = self.now
        raw = self._raw.pop(rid, None)
        if raw is not None and self.planner is not None:
            # the router's online calibration (timeline.score): actual vs predicted, per request
            self.planner.learn(raw, rec.ttft, rec.tpot, rec.tokens)
        pair = self.routes.pop(rid, (w, None))
        for x in pair:
            if x is not None:
                x.outstanding = max(0, x.outstanding - 1)
                x.load.remove(rid)
        if pair[1] is not None and w is pair[0]:
            pair[1].cancel(rid)  # done on P: free D's reservation
        conv = self._conv.get(rid)
        if conv is not None:
            self._next_by_conv(conv)

    # ---- conversations -------------------------------------------------------------------
    def _next_by_conv(self, conv: int) -> None:
        queue = self._next_turn.get(conv)
        if not queue:
            return
        nxt = queue.popleft()
        self.at(max(self.now, nxt.arrival), lambda: self._arrive(nxt))

    # ---- autobalance ----------------------------------------------------------------------
    def _balance(self) -> None:
        assert self.autobalancer is not None and self.planner is not None
        if self._heap:
            self.at(self.now + 1.0, self._balance)
        if any(w.draining for w in self.workers):
            for w in self.workers:
                if w.draining and w.idle and not w.load.jobs:
                    w.role, w.draining = self._target[w.wid], False
                    self.count(f"role_{w.role}")
            return
        pools = self._pools()
        everyone = pools["prefill"] + pools["decode"]
        sample = balancer.pressures(
            [w.load for w in pools["prefill"] or everyone],
            [w.load for w in pools["decode"] or everyone],
            self.planner,
            self.now,
            len(pools["prefill"]),
            len(pools["decode"]),
        )
        move = self.autobalancer.observe(self.now, sample)
        if move is None:
            return
        src, dst = ("decode", "prefill") if move == "to_prefill" else ("prefill", "decode")
        if not pools[src]:
            return
        w = min(pools[src], key=lambda x: (x.outstanding, x.wid))
        w.draining = True
        self._target[w.wid] = dst
        self.count(f"autobalance_{move}")
