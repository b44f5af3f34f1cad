"""A simulated engine instance (`SimWorker`): the engine's real `Scheduler` over the KV
managers the engine would build for the model (sim/kv_groups.py), stepping in simulated time,
and P's side of a KV hand-off (`Outgoing`).

The worker sees the simulation through `Loop`: its clock and event heap, and the router's
handlers of what the worker reports (a reservation, a token, a hand-off's last byte, an end).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerOutput, SchedulerPolicy
from pdserve.engine.spec.pacing import DraftPacer
from pdserve.router.loads import WorkerLoad
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.worker_stats import WorkerStats
from pdserve.sim.kv_groups import complete_from, handoff_bytes, kv_manager
from pdserve.sim.pool import SimKVPool
from pdserve.sim.records import SimConfig, SimRequest
from pdserve.sim.spec import SpecDraws
from pdserve.sim.steptime import Link, Row, StepModel
from pdserve.workers.messages import KVEvents

TOKEN = 7  # every sampled token (never an eos: requests stop at max_tokens, ignore_eos)


class Loop(Protocol):
    """What a worker needs from the simulation (sim/cluster.py `Simulation`)."""

    config: SimConfig
    link: Link
    now: float
    prefix: PrefixIndex  # the router's, fed with the workers' KVEvents
    kvpool: SimKVPool | None  # shared by every worker, when the deployment has one
    spec: SpecDraws | None  # speculative decoding's accepted drafts, when configured

    def at(self, t: float, fn: Callable[[], None]) -> None: ...
    def run_step(
        self, wid: str, rows: list[Row], work: float, done: Callable[[], None], kind: str = ""
    ) -> None: ...
    def on_reserved(self, dest: SimWorker, rid: str, have_tokens: int) -> None: ...
    def on_token(self, w: SimWorker, rid: str, finished: bool) -> None: ...
    def on_kv_done(self, p: SimWorker, o: Outgoing) -> None: ...
    def on_finished(self, w: SimWorker, rid: str) -> None: ...
    def count(self, key: str) -> None: ...


@dataclass
class Outgoing:
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
    window_from: int = 0  # sliding layers send their KV from this token on (kv_groups.py)


class SimWorker:
    """One engine instance: the real scheduler, stepping in simulated time."""

    def __init__(
        self, sim: Loop, wid: str, role: str, step: StepModel, policy: SchedulerPolicy
    ) -> None:
        self.sim, self.wid, self.role, self.step = sim, wid, role, step
        # the engine's KV groups for the model's sliding layers, sized as the engine sizes them
        self.kv = kv_manager(step, sim.config, policy, lambda: sim.now)
        self.sched = Scheduler(policy, self.kv)
        self.load = WorkerLoad(wid)
        self.outstanding = 0
        self.link = Link(sim.link.bytes_s * step.gpus, sim.link.per_message_s)
        self.busy = False
        self.speed = 1.0  # step speed against the step model's (its threads: sim/cluster.py)
        self.held = False  # steps held by the thread policy (`hold`)
        self.draining = False
        self.reserving: deque[Request] = deque()  # ExpectKV waiting for blocks
        self.turns: dict[str, SimRequest] = {}  # reserving: their conversations' turns
        self.reserved: dict[str, tuple[Request, float]] = {}
        self.receiving: deque[tuple[str, float]] = deque()  # KV in, D's receive work owed
        self.outgoing: dict[str, Outgoing] = {}
        self.busy_s = 0.0
        self.steps = 0
        self.kv_seq = 0
        self.log: list[tuple[float, str, str]] = []  # (time, what, rid): scheduling decisions
        self.pool_tokens: dict[str, int] = {}  # rid -> prompt tokens loaded from the KV pool
        self._pool_probed: set[str] = set()
        self.answers: dict[str, tuple[int, ...]] = {}  # rid -> the tokens its answer streams
        self.spec_steps = self.spec_drafted = self.spec_accepted = 0
        spec = sim.spec.model if sim.spec is not None else None
        self.pacer = DraftPacer(spec.tokens) if spec is not None and spec.paced else None

    # ---- what the router reads (router/decide.py `Candidate`) ----------------------------
    @property
    def worker_id(self) -> str:
        return self.wid

    @property
    def stats(self) -> WorkerStats:
        """What a real worker would report now (the router's copy lags by up to a second)."""
        return WorkerStats(waiting=self.sched.num_waiting, running=self.sched.num_running)

    # ---- intake ------------------------------------------------------------------------------
    def generate(self, req: SimRequest) -> None:
        request = self._request(req, req.max_tokens)
        self.sched.add_request(request)
        self._mark_turn(req, request)
        self.kick()

    def prefill(self, req: SimRequest, dest: SimWorker) -> None:
        request = self._request(req, 1)
        request.hold_kv = True
        window_from = complete_from(self.step, len(req.prompt))
        self.outgoing[req.rid] = Outgoing(req.rid, dest, window_from=window_from)
        self.sched.add_request(request)
        self.kick()

    def expect(self, req: SimRequest) -> None:
        """ExpectKV: reserve blocks for the prompt's KV (as `LLMEngine.reserve_kv`)."""
        request = self._request(req, req.max_tokens)
        self.sched.check_fits(request)
        self.turns[req.rid] = req
        self.reserving.append(request)
        self._try_reserve()

    def _mark_turn(self, req: SimRequest | None, request: Request) -> None:
        """A conversation's turn decoded here is kept when it ends (`mark_turn`, as the worker
        does for a Generate or an ExpectKV carrying a conversation; multi-turn reuse on)."""
        if req is not None and req.conversation >= 0 and self.sim.config.multiturn_reuse:
            self.kv.mark_turn(request, str(req.conversation))

    def cached_prefix(self, req: SimRequest) -> int:
        """Tokens of `req`'s prompt this worker's prefix cache holds now (whole blocks, the
        last token left to compute): what the router's prefix index reports of it."""
        return self.kv.peek_cached_prefix_tokens(self._request(req, req.max_tokens))

    def _request(self, req: SimRequest, max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if req.answer:
            self.answers[req.rid] = req.answer
        return Request(req.rid, list(req.prompt), params, arrival_time=req.arrival)

    def _token(self, request: Request) -> int:
        """The request's next sampled token: its answer's, else `TOKEN`."""
        answer = self.answers.get(request.request_id, ())
        i = len(request.output_token_ids)
        return answer[i] if i < len(answer) else TOKEN

    def _try_reserve(self) -> None:
        while self.reserving:
            request = self.reserving[0]
            n_kv = request.num_prompt_tokens
            # as LLMEngine.reserve_kv: the sliding layers' KV arrives for their window only
            complete = complete_from(self.step, n_kv)
            got = self.kv.reserve_with_prefix(request, n_kv + 1, n_kv - 1, complete)
            if got is None:
                return  # retried after the next step frees blocks
            self.reserving.popleft()
            self._mark_turn(self.turns.pop(request.request_id, None), request)
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
        request.output_token_ids = [self._token(request)]
        request.num_computed_tokens = request.num_prompt_tokens
        if request.num_tokens >= request.num_prompt_tokens + request.sampling_params.max_tokens:
            self.kv.free(rid)  # the first token was the last: nothing to decode
            self.sim.on_finished(self, rid)
            return
        self.sched.add_prefilled(request)
        self.log.append((self.sim.now, "admit", rid))
        self.kick()

    def cancel(self, rid: str) -> None:
        self.turns.pop(rid, None)
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
    def hold(self, held: bool) -> None:
        """The thread policy's `hold_decode` (router/threads.py): no engine step while held,
        hand-offs still received, as the served worker's `SetThreads(0)`."""
        was, self.held = self.held, held
        if was and not held:
            self.kick()

    def kick(self) -> None:
        if self.busy:
            return
        self.kv.expire_kept()  # as the worker loop, each turn: kept turns past their TTL go
        if self.receiving:  # hand-offs received during the last step come first
            rid, work = self.receiving.popleft()
            self.busy, t0 = True, self.sim.now
            # memory copies: on a shared host, slowed as a decode step (the nearer kind)
            self.sim.run_step(self.wid, [], work, lambda: self._received(rid, t0), "decode")
            return
        if self.held:
            return
        pinned, load_s = self._pool_load()
        out = self.sched.schedule()
        for rid in pinned:  # the scheduler has found them: the requests' own blocks hold them
            self._pool_kv().unpin(rid)
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
        drafts = self._drafts(out)
        # a speculating sequence's drafts are more decode rows, each over its context
        priced = rows + [(1, s.start_pos + j) for s in out.scheduled
                         for j in range(1, drafts.get(s.request_id, 0) + 1)]  # fmt: skip
        work = self.step.step_s(priced) / self.speed + load_s
        if self.pacer is not None:  # as the engine: pure-decode steps price verify rows
            pure = all(n == 1 for n, _ in rows) and not load_s
            self.pacer.observe_step(len(priced), work, pure)
        self.sim.run_step(self.wid, rows, work, lambda: self._step_done(out, t0, drafts))

    def _pool_load(self) -> tuple[list[str], float]:
        """Load waiting requests' prefixes from the KV pool before a step (engine/pool_link.py
        `prefetch`): those not looked up yet, with nothing computed, in queue order, up to a
        step's token budget. Returns the requests holding loaded blocks and the load's time."""
        pool = self.sim.kvpool
        if pool is None:
            return [], 0.0
        pinned, load_s, tokens = [], 0.0, 0
        for request in self.sched.waiting:
            if tokens >= self.sched.policy.max_num_batched_tokens:
                break
            tokens += request.num_tokens - request.num_computed_tokens
            rid = request.request_id
            if rid in self._pool_probed or request.num_computed_tokens > 0:
                continue
            self._pool_probed.add(rid)
            kv = self._pool_kv()
            _, hashes = kv.pool_candidates(request)
            n = pool.lookup(hashes) if hashes else 0
            if n == 0:
                continue
            loaded = len(kv.import_blocks(request, hashes[:n])) * kv.block_size
            pinned.append(rid)
            self.pool_tokens[rid] = loaded
            load_s += pool.load_s(loaded * self.step.kv_bytes_per_token)
        return pinned, load_s

    def _pool_kv(self) -> KVCacheManager:
        """The one block table of a worker with a KV pool (kv_groups.kv_manager gives a mixed
        model no KV groups there: the pool's loads here go through one manager)."""
        assert isinstance(self.kv, KVCacheManager)
        return self.kv

    def _received(self, rid: str, t0: float) -> None:
        self.busy = False
        self.busy_s += self.sim.now - t0
        self.admit(rid)  # kicks the next step (or the next receive)
        self.kick()

    def _drafts(self, out: SchedulerOutput) -> dict[str, int]:
        """Draft tokens per decode row this step (sim/spec.py), none on a prefill worker."""
        if self.sim.spec is None or self.role == "prefill":
            return {}
        decodes = []
        for s in out.scheduled:
            request = self.sched.requests.get(s.request_id)
            if s.num_tokens != 1 or not s.sample or request is None:
                continue
            if not request.num_output_tokens:
                continue  # a prompt's last token is no decode
            decodes.append((s.request_id, request))
        cap = self.pacer.cap(len(decodes)) if self.pacer is not None and decodes else None
        drafts = {}
        for rid, request in decodes:
            left = request.sampling_params.max_tokens - request.num_output_tokens
            n = self.sim.spec.model.drafts(left)
            n = n if cap is None else min(n, cap)
            if n:
                drafts[rid] = n
        return drafts

    def _accept(self, drafts: dict[str, int], finished: set[str]) -> dict[str, int]:
        """Append each speculating request's accepted drafts (their KV was computed in the
        verifying step); returns the tokens added per request, `finished` extended."""
        spec, extra = self.sim.spec, {}
        for rid, n in drafts.items():
            request = self.sched.requests.get(rid)
            if spec is None or request is None or rid in finished:
                continue
            self.spec_steps, self.spec_drafted = self.spec_steps + 1, self.spec_drafted + n
            k = spec.accepted(rid, n)
            if self.pacer is not None:
                self.pacer.observe_verify(n, k)
            for _ in range(k):
                request.append_token(self._token(request))
            if k and self.kv.allocate_slots(request, k) is None:
                del request.output_token_ids[-k:]  # no block for them: verified, not kept
                self.sim.count("spec_dropped_no_memory")
                continue
            request.num_computed_tokens += k
            self.spec_accepted += k
            extra[rid] = k
            status = request.check_stop()
            if status is not None:
                self.sched.finish_request(rid, status)
                finished.add(rid)
        return extra

    def _step_done(self, out: SchedulerOutput, t0: float, drafts: dict[str, int]) -> None:
        self.busy, dur = False, self.sim.now - t0  # longer than step_s when the host is shared
        self.busy_s += dur
        for s in out.scheduled:
            o = self.outgoing.get(s.request_id)
            if o is not None:
                o.chunks.append((s.start_pos, s.num_tokens, t0, dur))
        requests = self.sched.requests
        sampled = {
            s.request_id: self._token(requests[s.request_id]) if s.request_id in requests else TOKEN
            for s in out.scheduled
            if s.sample
        }
        finished = {r.request_id for r in self.sched.update_from_output(out, sampled)}
        extra = self._accept(drafts, finished)
        for rid in sampled:
            o = self.outgoing.get(rid)
            if o is not None:
                o.prefill_done = True
                self.sim.on_token(self, rid, finished=False)
                self._flush(o)
                continue
            for _ in range(extra.get(rid, 0)):  # accepted drafts: streamed with this step's
                self.sim.on_token(self, rid, finished=False)
            self.sim.on_token(self, rid, finished=rid in finished)
        self._kv_events()
        self._try_reserve()
        self.kick()

    # ---- KV transfer (P side) ----------------------------------------------------------
    def on_reserved(self, rid: str, at: float, have_tokens: int) -> None:
        o = self.outgoing.get(rid)
        if o is None:
            return
        o.reserved_at, o.have_tokens = at, have_tokens
        self._flush(o)

    def _flush(self, o: Outgoing) -> None:
        """Send the chunks computed so far (once D has reserved); hand off when all are sent."""
        if o.reserved_at is None:
            return
        for start, n, t0, dur in o.chunks:
            lo = max(start, o.have_tokens)  # D's cached prefix is not sent
            tokens = max(0, start + n - lo)
            nbytes = handoff_bytes(self.step, lo, start + n, o.window_from)
            o.nbytes += int(nbytes)
            o.tokens += tokens
            done = self.link.stream(t0, dur, nbytes, self.step.layers, o.reserved_at)
            o.sent_until = max(o.sent_until, done)
        o.chunks.clear()
        if o.prefill_done:
            del self.outgoing[o.rid]
            at = max(o.sent_until, self.sim.now) + self.link.per_message_s
            self.sim.at(at, lambda: self.sim.on_kv_done(self, o))

    def _kv_events(self) -> None:
        """The blocks the step registered go into the KV pool, and (prefix routing) the
        router's prefix index hears of them as of a real worker's KVEvents."""
        routing, pool = self.sim.config.prefix_routing, self.sim.kvpool
        if not (routing or pool is not None) or not self.kv.has_events:
            return
        stored, removed, cleared = self.kv.take_events()
        if pool is not None:
            pool.put(stored)
        if not routing:
            return
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
