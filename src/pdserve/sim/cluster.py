"""The discrete-event simulation of a deployment: router, P / D / colocated workers, KV links.

Only time is simulated. Every decision is the real code's:
  * each worker (sim/worker.py) is the engine's `Scheduler` over the KV manager the engine
    would build for the model (sim/kv_groups.py: a KV group per layer kind on a model mixing
    sliding and global layers; block ids only: the simulator has no tensors, so the manager
    *is* the fake block store);
    `schedule()` decides every step, `update_from_output` advances it; preemption, chunking,
    prefix caching, held KV and reservations are the engine's own;
  * the router's decisions are router/decide.py, the code router/routing.py calls: `plan`
    (`SloPlanner.routes/decide`: admission, conditional disaggregation) or the policies' `pick`,
    and `book` on the `WorkerLoad`s; the planner's online calibration is `SloPlanner.learn`
    from each finished request, as `router/timeline.py` calls it; `PrefixIndex` is fed with the
    workers' real `KVEvents`; `balancer.pressures` + `Autobalancer` move roles.

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

from pdserve.costmodel.capacity import speedup
from pdserve.costmodel.contention import Contention
from pdserve.router import balancer, decide, slo, threads
from pdserve.router.decide import ROLES
from pdserve.router.loads import less_held
from pdserve.router.policies import make_policy
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.threads import ThreadPolicy
from pdserve.sim.closedloop import ClosedLoop, LoopDriver
from pdserve.sim.host import Host, step_kind
from pdserve.sim.pool import SimKVPool
from pdserve.sim.records import Record, SimConfig, SimRequest
from pdserve.sim.spec import SpecDraws
from pdserve.sim.steptime import Link, Row, StepModel
from pdserve.sim.worker import Outgoing, SimWorker

MOVE_INTERVAL_S = 0.25  # as the router's ThreadMover samples
# Record, SimConfig and SimRequest live in sim/records.py; sim/deploy.py still imports them here.
__all__ = ["Record", "SimConfig", "SimRequest", "SimWorker", "Simulation"]


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
        self.kvpool: SimKVPool | None = None
        if config.kv_pool:
            self.kvpool = SimKVPool(config.kv_pool_blocks, config.kv_pool_bytes_s or link.bytes_s,
                                    link.per_message_s)  # fmt: skip
        self.spec = SpecDraws(config.spec) if config.spec is not None else None
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
        self.thread_policy = (
            # the profile is the starting split's: cores / 2 threads a worker, as `pdserve
            # serve --adaptive` loads
            ThreadPolicy(
                cores=config.thread_cores,
                profiled_threads=max(1, config.thread_cores // 2),
                grain_tokens=config.thread_grain,
            )
            if config.thread_cores
            else None
        )
        self.threads: dict[str, int] = {}  # worker -> threads (the step model's: 1) when moved
        self.records: dict[str, Record] = {}
        self.routes: dict[str, tuple[SimWorker, SimWorker | None]] = {}
        self.counters: dict[str, int] = {}
        self._next_turn: dict[int, deque[SimRequest]] = {}
        self._conv: dict[str, int] = {}
        self._conv_worker: dict[int, SimWorker] = {}  # conversation -> who decoded its last turn
        self.loop: LoopDriver | None = None  # the closed loop sending the requests, if any
        self._target: dict[str, str] = {}  # draining worker -> its next role
        self.decisions: list[tuple[float, str, str, str]] = []  # (time, rid, route, workers)
        self._raw: dict[str, tuple[float, ...]] = {}  # uncalibrated predictions, to learn from
        self._held_first: dict[str, float] = {}  # its decoder's `held_s` at its first token

    # ---- the loop ----------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run(
        self,
        requests: Sequence[SimRequest],
        until: float = float("inf"),
        load: ClosedLoop | None = None,
    ) -> list[Record]:
        """Every request's record. Open loop (`load` None): each request arrives at its own
        time, a conversation's later turn once the previous one ended; `load`: the closed loop
        of `bench serve --concurrency` sends them (sim/closedloop.py)."""
        seen: set[int] = set()
        for req in sorted(requests, key=lambda r: r.arrival):
            if req.rid in self.records:
                raise ValueError(f"duplicate request id {req.rid!r}")
            rec = Record(req.rid, len(req.prompt), req.max_tokens, req.phase, turn=req.turn)
            self.records[req.rid] = rec
            if req.conversation >= 0:
                self._conv[req.rid] = req.conversation
            if load is not None:
                continue
            if req.conversation >= 0 and req.conversation in seen:
                self._next_turn.setdefault(req.conversation, deque()).append(req)
                continue
            seen.add(req.conversation)
            self.at(req.arrival, lambda r=req: self._arrive(r))  # type: ignore[misc]
        if load is not None:
            self.loop = LoopDriver(load, requests, self.at, lambda: self.now, self._arrive)
            self.loop.start()
        if self.autobalancer is not None:
            self.at(1.0, self._balance)
        if self.thread_policy is not None:
            self.at(0.0, self._move_threads)
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
        limit = self.config.max_model_len
        if limit is not None and len(req.prompt) >= limit:
            # the engine refuses it before any work (LLMEngine: "the prompt has N tokens but
            # the context holds M"), as a client's mistake
            rec.rejected = "invalid_request"
            self.count("rejected_invalid_request")
            self._ended(req.rid)
            return
        follow = self._follow(req)
        pair, pred = (follow[0], None) if follow is not None else self._route(req)
        if pair is None:
            rec.rejected = pred.reject if isinstance(pred, slo.Decision) else "unavailable"
            self.count(f"rejected_{rec.rejected}")
            self._ended(req.rid)  # the conversation's next turn
            return
        first, second = pair
        chosen = pred.chosen if isinstance(pred, slo.Decision) else None
        kind = decide.route_kind(first.role, second is not None, chosen, forced=False)
        kind = follow[1] if follow is not None else kind
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
            loads = (first.load, second.load if second is not None else None)
            decide.book(self.planner, req.rid, loads, len(req.prompt), req.max_tokens, self.now,
                        chosen)  # fmt: skip
        self.at(self.now + self.config.message_s, lambda: self._dispatch(req, first, second))

    def _route(
        self, req: SimRequest
    ) -> tuple[tuple[SimWorker, SimWorker | None] | None, slo.Decision | None]:
        """The router's decision (router/decide.py): `plan` with a planner, else `pick`."""
        pools = self._pools()
        if self.planner is None:
            return decide.pick(pools, self.policies), None
        ids = [w.wid for r in ROLES for w in pools[r]]
        if not ids:
            return None, None
        cached: dict[str, int] = {}
        if self.config.prefix_routing:
            cached = decide.cached_tokens(self.prefix, req.prompt, self.config.block_size, ids)
        return decide.plan(
            self.planner, pools, len(req.prompt), req.max_tokens, self.now, cached=cached
        )

    def _follow(self, req: SimRequest) -> tuple[tuple[SimWorker, SimWorker | None], str] | None:
        """A later turn's workers and route by the router's rule (router/routing.py `follow`):
        to the worker that decoded the previous turn, while it still decodes, prefilled there
        ("reuse") when at most `conversation_local_tokens` of the prompt are not in its prefix
        cache (`decide.follow_up_local`), else on P, D then receiving only the blocks it lacks
        ("remote"; counted: the history was lost). None: not a follow-up, routed as any."""
        if not self.config.multiturn_reuse or req.turn == 0 or req.conversation < 0:
            return None
        w = self._conv_worker.get(req.conversation)
        if w is None or w.draining or w.role == "prefill":
            return None
        prefill = self._pools()["prefill"]
        cached = w.cached_prefix(req)  # what the router's prefix index says of it
        limit = self.config.conversation_local_tokens
        local = decide.follow_up_local(len(req.prompt), cached, limit)
        # a reuse hit, or D lacks too much of it: the history is lost (to P when there is one)
        self.count("multiturn_reuse_hits" if local else "multiturn_history_lost")
        if local or not prefill:
            return (w, None), "reuse"
        return (decide.choose(self.policies["prefill"], prefill), w), "remote"

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
                self._held_first[rid] = self._decoder(rid, w).load.held_s(now)
                rec.cached_tokens = w.cached_tokens(rid)
                rec.pool_tokens = w.pool_tokens.get(rid, 0)
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

    def _decoder(self, rid: str, w: SimWorker) -> SimWorker:
        """The worker that decodes `rid` (`w`, the one that sent the token, when unrouted)."""
        pair = self.routes.get(rid, (w, None))
        return pair[1] or pair[0]

    def on_kv_done(self, p: SimWorker, o: Outgoing) -> None:
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
        if self.spec is not None:
            self.spec.forget(rid)
        raw = self._raw.pop(rid, None)
        first = self._held_first.pop(rid, None)
        if raw is not None and self.planner is not None:
            # the router's online calibration (timelines.score): actual vs predicted, per
            # request, its TPOT less its decoder's holds
            tpot, dec = rec.tpot, self._decoder(rid, w).load
            if first is not None and rec.last_at is not None:
                tpot = less_held(tpot, dec.held_s(rec.last_at) - first, rec.tokens)
            job = dec.jobs.get(rid)
            self.planner.learn(raw, rec.ttft, tpot, rec.tokens, job.seen() if job else None)
        pair = self.routes.pop(rid, (w, None))
        for x in pair:
            if x is not None:
                x.outstanding = max(0, x.outstanding - 1)
                x.load.remove(rid)
        if pair[1] is not None and w is pair[0]:
            pair[1].cancel(rid)  # done on P: free D's reservation
        conv = self._conv.get(rid)
        if conv is not None:
            self._conv_worker[conv] = w
        self._ended(rid)

    # ---- conversations -------------------------------------------------------------------
    def _ended(self, rid: str) -> None:
        """A request finished or was rejected: the closed loop's slot frees, or (open loop)
        its conversation's next turn may go."""
        if self.loop is not None:
            self.loop.ended(rid)
            return
        conv = self._conv.get(rid)
        if conv is not None:
            self._next_by_conv(conv)

    def _next_by_conv(self, conv: int) -> None:
        queue = self._next_turn.get(conv)
        if not queue:
            return
        nxt = queue.popleft()
        self.at(max(self.now, nxt.arrival), lambda: self._arrive(nxt))

    # ---- autobalance ----------------------------------------------------------------------
    def _move_threads(self) -> None:
        """The router's ThreadMover (router/thread_moves.py) on simulated time: the same pure
        policy every MOVE_INTERVAL_S; a worker's steps speed up by the cost model's thread
        scaling (`capacity.speedup`, against the starting split's, whose profile the step model
        is: cores / 2 threads a worker, as `pdserve serve --adaptive` loads)."""
        assert self.thread_policy is not None and self.planner is not None
        if self._heap:
            self.at(self.now + MOVE_INTERVAL_S, self._move_threads)
        pools = self._pools()
        p = {w.wid: w.load for w in pools["prefill"]}
        d = {w.wid: w.load for w in pools["decode"]}
        moves = self.thread_policy.moves
        resume = self.thread_policy.resume_slowness(len(p), len(d))
        s = threads.sample(p, d, self.planner, self.now, resume)
        targets = self.thread_policy.observe(self.now, s)
        if self.thread_policy.moves != moves and self.threads:
            self.count("thread_moves")
        steps = self.thread_policy.step_tokens(targets)
        for wid, n in targets.items():
            self.threads[wid] = n
            base = self.thread_policy.profiled_threads
            w = self.byid[wid]
            w.sched.step_tokens = steps[wid] or None  # as the served worker's `SetThreads`
            if n == 0 and not w.held:
                self.count("decode_holds")
            w.hold(n == 0)  # 0: D holds its steps (`hold_decode`); its threads stay as they were
            w.load.set_held(n == 0, self.now)
            if n:
                w.speed = speedup(n) / speedup(base)
                w.load.slowness = threads.slowness(n, base)  # as the router's mover
        threads.price(self.thread_policy, s, {**p, **d}, self.planner)

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
