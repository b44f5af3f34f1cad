"""SLO-aware routing: predict each request's TTFT and TPOT on every route, admit, choose.

Pure policy (no sockets, no asyncio): the RouterCore keeps a `WorkerLoad` per worker (what it
has sent there and not seen finish), asks `SloPlanner.decide` where a new request should go, and
tells the loads about dispatches, first tokens, deliveries and ends.

Routes: `remote` (prefill on P, KV to D, decode on D), `local` (the whole request on a decode
worker: prefill there, no transfer) and `colocated` (a colocated worker). For each candidate the
cost model predicts

    TTFT = the worker's queued prefill work + this prompt's prefill (new tokens after what the
           worker already caches), stretched by the decode steps it shares while it computes
    TPOT = D's decode step with one more request and its context, plus, spread over the answer,
           what is left of D's queued prefills when it starts decoding there (they stall every
           step; prefills run in arrival order) and the KV transfer (remote: the wire, and D's
           own work to register the KV, `CostModel.receive_s`)

and checks the requests on D, decoding or still waiting for their first token: a local prefill
(or a hand-off's receive) stalls each of them, a bigger batch slows each step; one predicted to
end within its TPOT SLO must stay within it ("slo_tpot_running"). A local route is also charged
the stall of the requests expected to reach D while it prefills (`arrivals.future_stall`) and, where
P and D share cores (`--adaptive`), the slower prefills of P's queued prompts meanwhile; one
predicted within its TTFT SLO must stay within it ("slo_ttft_queued", `_queued_stretch`). A request
whose every route misses an SLO is rejected before any prefill is spent (when admission is on);
otherwise the feasible route with the least predicted latency (the new request's end-to-end plus
the delay it adds to running ones) wins. Mode `overflow` (`--adaptive`) keeps prompts on P while
a remote route meets the SLOs: D prefills only when P's queue would break the TTFT SLO and the
local route still keeps D's TPOT (a burst), never on an idle P.
Cached prefixes enter as fewer new tokens, so "longest cached prefix, weighed against load" falls
out of the same sum.

Predictions are corrected online: the ratio actual/predicted of finished requests (an
exponential average, per TTFT and TPOT) scales the raw model, which is fitted offline on one
process and misses the serving loop's own overheads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.costmodel.model import CostModel
from pdserve.router.arrivals import Arrivals, future_stall
from pdserve.router.batch import decode_starts, drained, overlaps
from pdserve.router.loads import Job, WorkerLoad
from pdserve.router.pool_index import PoolBandwidth

ROUTES = ("remote", "local", "colocated")
# Finished requests `--adaptive`'s planner learns from before it refuses on predictions alone
CALIBRATION_PROBES = 3
CALIBRATION_MIN_TOKENS = 16  # shorter requests' TPOT does not calibrate the model (`learn`)
MODES = ("conditional", "always", "overflow")


@dataclass(frozen=True)
class Route:
    kind: str  # remote | local | colocated
    first: str  # the worker that prefills
    decode: str | None = None  # the decode worker of a remote route


@dataclass(frozen=True)
class Prediction:
    route: Route
    ttft_s: float
    tpot_s: float
    running_worst_s: float  # worst predicted TPOT of a protected running request (0: none)
    cost_s: float  # what the choice minimizes (after `misses`)
    cached_first: int  # prompt tokens the prefilling worker already caches
    cached_decode: int  # ... and the decode worker (KV it need not receive)
    # first SLO this route misses: slo_ttft | slo_tpot | slo_tpot_running | slo_ttft_queued
    miss: str | None = None
    misses: int = 0  # SLOs missed: this request's (TTFT, TPOT) + running requests pushed over
    pooled_first: int = 0  # prompt tokens after `cached_first` the prefilling worker loads
    # from its KV pool instead of computing them
    step_s: float = 0.0  # the model's decode step it was priced at (answer's batch, joiners)


@dataclass(frozen=True)
class Decision:
    chosen: Prediction | None  # None: rejected
    reject: str | None = None
    retry_after_s: int = 1
    considered: int = 0
    # admitted although predicted to miss: the planner had not yet learned from enough finished
    # requests to trust a refusal (CALIBRATION_PROBES); counted by the router
    probe: bool = False


@dataclass
class Calibration:
    """actual / predicted, averaged exponentially; starts at 1 (trust the fitted model)."""

    ttft: float = 1.0
    tpot: float = 1.0
    alpha: float = 0.2
    samples: int = 0

    def observe(self, kind: str, predicted: float, actual: float) -> None:
        if predicted <= 0 or actual <= 0:
            return
        ratio = min(4.0, max(0.25, actual / predicted))
        setattr(self, kind, (1 - self.alpha) * getattr(self, kind) + self.alpha * ratio)
        self.samples += 1


class SloPlanner:
    def __init__(
        self,
        model: CostModel,
        *,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
        admission: bool = True,
        mode: str = "conditional",
        token_budget: int = 2048,
        expected_output: int = 256,
        kv_bytes_per_token: float = 0.0,
        handoff_overhead_s: float = 0.002,
        pool_bytes_per_s: float = 1e9,
        calibration_probes: int = 0,
    ) -> None:
        """`pool_bytes_per_s`: how fast a worker loads KV from its pool until its own loads say
        otherwise (`pool_bandwidth`, fed by the router: a pool hit costs its bytes at the
        worker's measured rate, against the prefill it saves). `calibration_probes`: finished
        requests to learn from before refusing on predictions alone (`decide`)."""
        if mode not in MODES:
            raise ValueError(f"disaggregation must be one of {', '.join(MODES)}, got {mode!r}")
        for name, v in (("slo_ttft", slo_ttft_s), ("slo_tpot", slo_tpot_s)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {v}")
        self.model, self.mode = model, mode
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.admission = admission and (slo_ttft_s is not None or slo_tpot_s is not None)
        self.token_budget, self.expected_output = token_budget, expected_output
        self.kv_bytes_per_token = kv_bytes_per_token
        # messages of a hand-off (ExpectKV, KVWant/Ready/Done/Ack) beyond the bytes: on a tie,
        # the route that uses one worker wins
        self.handoff_overhead_s = handoff_overhead_s
        self.pool_bytes_per_s = pool_bytes_per_s
        self.pool_bandwidth = PoolBandwidth(pool_bytes_per_s)
        self.calibration = Calibration()
        self.calibration_probes = calibration_probes
        self._probing = False  # a request admitted to calibrate is in flight
        self.arrivals = Arrivals()
        # per P, how many times slower its queued prompts run while a D prefills one itself
        # (`--adaptive`: threads.price); a local route is charged that (`_queued_stretch`)
        self.coupled: dict[str, float] = {}

    def arrival_rate(self) -> float:
        return self.arrivals.rate()

    def observe_transfer(self, nbytes: int, tokens: int) -> None:
        """A KV transfer of `tokens` tokens moved `nbytes`: learn KV bytes per token (codec,
        dtype) for the transfer times, as a moving average."""
        if nbytes <= 0:
            return
        per = nbytes / max(1, tokens)
        old = self.kv_bytes_per_token
        self.kv_bytes_per_token = per if old <= 0 else 0.8 * old + 0.2 * per

    # ---- online calibration --------------------------------------------------------------
    def uncalibrated(self, pred: Prediction) -> tuple[float, float, float]:
        """(TTFT, TPOT, the model's decode step) of `pred` before online calibration: what
        `learn` later compares with the request's actual latencies."""
        return pred.ttft_s / self.calibration.ttft, pred.tpot_s / self.calibration.tpot, pred.step_s

    def learn(
        self,
        raw: tuple[float, ...],
        ttft: float | None,
        tpot: float | None,
        tokens: int | None = None,
        seen: tuple[float, float] | None = None,
    ) -> None:
        """A finished request's actual TTFT / TPOT (None: not measured) against its
        uncalibrated prediction `raw`; `tokens`: how many it generated; `seen`: the mean
        decode batch it stepped in (`Job.seen`). The router and the simulator both call this.

        The TPOT is compared at the batch it met, not the one predicted: a burst that joined
        after a request was admitted is no error of the step model, and learned as one (4 of
        a burst at 30-40 ms predicted, 55-68 ms met) the calibration priced every later
        request 1.5-2x over its TPOT and admission refused requests that decoded at 40-68 ms.
        The TPOT of a request shorter than CALIBRATION_MIN_TOKENS is not learned: over a few
        steps it is the first steps' one-off costs (a 4-token warm-up at 45 ms a token against
        12.8 ms predicted moved the calibration to 1.5)."""
        self._probing = False
        if tokens is not None and tokens < CALIBRATION_MIN_TOKENS:
            tpot = None
        predicted_tpot = raw[1]
        if seen is not None and len(raw) > 2 and raw[2] > 0:
            predicted_tpot *= self.model.decode_step_s(seen[0], int(seen[1])) / raw[2]
        for kind, predicted, actual in (("ttft", raw[0], ttft), ("tpot", predicted_tpot, tpot)):
            if actual is not None and actual > 0:
                self.calibration.observe(kind, predicted, actual)

    # ---- the decision --------------------------------------------------------------------
    def routes(self, prefill: list[str], decode: list[str], colocated: list[str]) -> list[Route]:
        """Every candidate route over the healthy pools."""
        routes = [Route("remote", p, d) for p in prefill for d in decode]
        if self.mode != "always" or not routes:
            routes += [Route("local", d) for d in decode]
        routes += [Route("colocated", c) for c in colocated]
        if not routes:  # only prefill workers left: they run whole requests
            routes = [Route("local", p) for p in prefill]
        return routes

    def decide(
        self,
        prompt_len: int,
        max_tokens: int,
        routes: list[Route],
        loads: dict[str, WorkerLoad],
        cached: dict[str, int],
        now: float,
        *,
        admit_all: bool = False,
        streams: int = 1,
        pooled: dict[str, int] | None = None,
    ) -> Decision:
        """Predict every route; choose the cheapest feasible one, or reject. `pooled`: per
        worker, the prompt's leading tokens it could load from its KV pool."""
        if not routes:
            return Decision(None, "unavailable", 1)
        if not admit_all:  # a first attempt: an arrival (a retry is not a new request)
            self.arrivals.add(now)
        n_dec = max(1, len({r.decode or r.first for r in routes if r.kind != "colocated"}))
        rate = self.arrival_rate() / n_dec  # per decode worker
        args = (loads, cached, now, streams, pooled, rate, n_dec)
        preds = [self.predict(prompt_len, max_tokens, r, *args) for r in routes]
        feasible = [p for p in preds if p.miss is None]
        remote = [p for p in feasible if p.route.kind == "remote"]
        if self.mode == "overflow" and remote:  # D prefills only what P would make late
            return Decision(min(remote, key=lambda p: p.cost_s), considered=len(preds))
        if feasible:
            return Decision(min(feasible, key=lambda p: p.cost_s), considered=len(preds))
        # nothing meets every SLO: the route that breaks the fewest (a request that misses
        # anyway should not drag running ones down with it), then the cheapest
        best = min(preds, key=lambda p: (p.misses, p.cost_s))
        if admit_all or not self.admission:
            return Decision(best, considered=len(preds))
        if self.calibration.samples < 2 * self.calibration_probes and not self._probing:
            # An uncalibrated model that overestimates would refuse every request and, learning
            # only from finished ones, never find out (measured: a profile fitted on a busy host
            # predicted 1.7 s for a 900-token prefill that took 1.1 s, and a 2 s TTFT SLO
            # refused all of a sweep's requests). One request at a time is let through to learn.
            self._probing = True
            return Decision(best, considered=len(preds), probe=True)
        return Decision(None, best.miss, self._retry_after(best), len(preds))

    def _retry_after(self, p: Prediction) -> int:
        over = p.ttft_s - (self.slo_ttft_s or p.ttft_s)
        return max(1, math.ceil(over))

    def predict(
        self,
        prompt_len: int,
        max_tokens: int,
        route: Route,
        loads: dict[str, WorkerLoad],
        cached: dict[str, int],
        now: float,
        streams: int = 1,
        pooled: dict[str, int] | None = None,
        decode_rate: float = 0.0,
        decoders: int = 1,
    ) -> Prediction:
        """`streams`: the request's decode sequences (n choices share one prefill); `pooled`:
        per worker, prompt tokens it could load from its KV pool (used when loading them is
        predicted faster than computing them); `decode_rate`: requests per second reaching
        each decode worker (`decide` measures it; see `arrivals.future_stall`); `decoders`: how
        many share the arrivals that join during the answer (`joining`)."""
        first = loads[route.first]
        dec = loads[route.decode] if route.decode is not None else first
        c_first = min(cached.get(route.first, 0), prompt_len - 1)
        c_dec = min(cached.get(dec.worker_id, 0), prompt_len - 1)
        out = max(1, min(max_tokens, self.expected_output))
        p_first = max(0, min((pooled or {}).get(route.first, 0), prompt_len - 1) - c_first)
        prefill = self.prefill_time(prompt_len, c_first, first)
        if p_first:
            with_pool = self.prefill_time(prompt_len, c_first, first, p_first)
            p_first = p_first if with_pool < prefill else 0
            prefill = min(prefill, with_pool)
        first_token = first.prefill_backlog(now) + prefill
        ttft = first_token * self.calibration.ttft
        local = route.kind != "remote"
        batch, ctx = dec.decode_streams(), dec.context_sum()
        per_stream = prompt_len + out // 2
        step_now = self.model.decode_step_s(max(1, batch), ctx) * dec.decode_factor()
        starts = decode_starts(dec, loads, now)
        overlap = overlaps(dec.decoding(), starts, first_token, out, step_now)
        step_new = self._mean_step(dec.decoding(), overlap, streams, per_stream, out)
        joins = self.arrivals.rate_over(now, out * step_new) / max(1, decoders)
        step_new += self.joining(batch + streams, ctx, per_stream, joins, out * step_new)
        step_s = step_new
        step_new = spec_step(self.model, step_new, dec.spec, batch + streams, per_stream)
        step_new *= dec.decode_factor()
        # D runs its queued prefills in arrival order, and each stalls the decode steps beside
        # it. Those queued now end before this request decodes if it prefills there (local,
        # colocated: its own prefill comes after them); on a remote route, only what is left
        # of them when its KV arrives stalls it. (Counting the whole queue rejected requests
        # that met both SLOs: two 2000-token prompts one second apart on an idle 1-thread
        # colocated worker, the second predicted at +13 ms a token for the first's prefill.)
        spread = 0.0 if local else max(0.0, dec.prefill_backlog(now) - first_token)
        transfer = receive = 0.0
        if not local:
            nbytes = int((prompt_len - c_dec) * self.kv_bytes_per_token)
            # D registers the KV on its own loop: the hand-off's latency, and a stall of D's
            # running decodes (costmodel/model.py: receive)
            receive = self.model.receive_s(prompt_len - c_dec)
            transfer = self.model.transfer_s(nbytes) + receive + self.handoff_overhead_s
        tpot = (step_new + (spread + transfer) / max(1, out - 1)) * self.calibration.tpot
        stall = prefill if local else receive
        worst, added, pushed = self._running(
            dec, batch, ctx, per_stream, stall, now, streams, overlap, decoders
        )
        late = 0
        if local:
            added += future_stall(prefill, decode_rate)
            if route.first not in self.coupled:
                stretch, late = self._queued_stretch(loads, prefill, now)
                added, pushed = added + stretch, pushed + late
        miss = self._miss(ttft, tpot if out > 1 else 0.0, worst, late)
        own = (self.slo_ttft_s is not None and ttft > self.slo_ttft_s) + (
            self.slo_tpot_s is not None and out > 1 and tpot > self.slo_tpot_s
        )
        cost = ttft + out * tpot + added
        return Prediction(
            route, ttft, tpot, worst, cost, c_first, c_dec, miss, own + pushed, p_first, step_s
        )

    def prefill_time(self, prompt_len: int, cached: int, w: WorkerLoad, pooled: int = 0) -> float:
        """This prompt's prefill on `w`, in chunks beside w's decodes (one step each); `pooled`
        tokens after the `cached` ones are loaded from the KV pool (their bytes at w's measured
        pool bandwidth) rather than computed."""
        load = (
            pooled * self.kv_bytes_per_token / self.pool_bandwidth.rate(w.worker_id)
            if pooled
            else 0.0
        )
        cached += pooled
        new = prompt_len - cached
        batch = w.decode_streams()
        if batch == 0:
            return self.model.prefill_s(new, cached) * w.prefill_rate() + load
        chunks = math.ceil(new / max(1, self.token_budget - batch))
        compute = self.model.prefill_s(new, cached) + chunks * self.model.decode_step_s(
            batch, w.context_sum()
        )
        return compute * w.prefill_rate() + load

    def _mean_step(
        self, jobs: list[Job], overlap: dict[str, float], streams: int, per_stream: int, out: int
    ) -> float:
        """The new request's mean decode step over its `out` steps: the jobs decoding on its
        worker leave the batch after their `overlap` steps of its own (the step cost is
        piecewise linear in the batch, so the batch is walked segment by segment)."""
        batch = streams + sum(j.streams for j in jobs)
        ctx = streams * per_stream + sum(j.context * j.streams for j in jobs)
        total, done = 0.0, 0.0
        for j in sorted(jobs, key=lambda j: overlap[j.rid]):
            steps = overlap[j.rid] - done
            if steps > 0:
                total, done = total + steps * self.model.decode_step_s(batch, ctx), done + steps
            batch, ctx = batch - j.streams, ctx - j.context * j.streams
        total += (out - done) * self.model.decode_step_s(batch, ctx)
        return total / out

    def joining(self, batch: int, ctx: int, per_stream: int, rate: float, window: float) -> float:
        """What the requests reaching the decode worker during the new request's decode
        (`window` seconds at the profile's speed) add to its mean step: `rate` a second, each
        sharing on average half of the window (`rate`: `Arrivals.rate_over` the window, per
        decode worker). Why: `_mean_step` sees only the batch of the
        moment, which drains; at the seeds' case's 0.6 req/s the batch that arrivals keep
        made TPOTs 2-4x the predictions, the calibration learned that ratio and then applied it
        to running requests' steps at their full batch too, and refused requests (slo_tpot_
        running) that decoded within the SLO."""
        extra = rate * window / 2
        if extra <= 0:
            return 0.0
        before = self.model.decode_step_s(batch, ctx)
        return self.model.decode_step_s(batch + extra, int(ctx + extra * per_stream)) - before

    def _running(
        self,
        dec: WorkerLoad,
        batch: int,
        ctx: int,
        new_ctx: int,
        stall: float,
        now: float,
        streams: int,
        overlap: dict[str, float],
        decoders: int = 1,
    ) -> tuple[float, float, int]:
        """(worst protected TPOT, total added delay, how many pushed past the SLO) of the
        requests decoding on `dec` if this request joins: `stall` seconds of prefill in their
        steps, then one more in the batch for the steps they share with it (`overlap`). Each
        one's own steps are priced as a new request's are: at the batch it meets as the others
        finish (`batch.drained`) and the requests that join meanwhile (`joining`)."""
        if batch == 0:
            return 0.0, 0.0, 0
        k = self.calibration.tpot * dec.decode_factor()  # `stall` is already dec's own time
        step_old = self.model.decode_step_s(batch, ctx) * k
        step_new = self.model.decode_step_s(batch + streams, ctx + streams * new_ctx) * k
        stall *= self.calibration.tpot
        worst, added, pushed = 0.0, 0.0, 0
        drains = drained(dec.decoding())
        for j in dec.decoding():
            tokens = j.generated + j.remaining
            shared = min(j.remaining, overlap[j.rid])
            added += stall + shared * (step_new - step_old)
            if self.slo_tpot_s is None or tokens < 2:
                continue
            # A request still waiting for its first token here (prefilling ahead of this one,
            # or its KV on the way from P) decodes through this stall too.
            ran = max(0.0, now - j.first_at) if j.first_at is not None else 0.0
            # at most the batch of the moment throughout (the rule before the drain, which
            # priced the arrivals and the departures as even)
            b, c = drains[j.rid]
            own = self.model.decode_step_s(b, int(c))
            joins = self.arrivals.rate_over(now, j.remaining * own * k) / max(1, decoders)
            own += self.joining(round(b), int(c), new_ctx, joins, j.remaining * own * k)
            own = min(own * k, step_old)
            old = (ran + j.remaining * own) / (tokens - 1)
            new = old + (stall + shared * (step_new - step_old)) / (tokens - 1)
            if old <= self.slo_tpot_s < new:
                worst, pushed = max(worst, new), pushed + 1
        return worst, added, pushed

    def _miss(self, ttft: float, tpot: float, running_worst: float, late: int) -> str | None:
        if self.slo_ttft_s is not None and ttft > self.slo_ttft_s:
            return "slo_ttft"
        if self.slo_tpot_s is not None and tpot > self.slo_tpot_s:
            return "slo_tpot"
        if running_worst > 0:
            return "slo_tpot_running"
        if late:
            return "slo_ttft_queued"
        return None

    def _queued_stretch(
        self, loads: dict[str, WorkerLoad], local_s: float, now: float
    ) -> tuple[float, int]:
        """(delay added, prompts pushed past the TTFT SLO) over the prompts queued on the
        `coupled` P workers while a D prefills for `local_s` seconds itself: P runs f times
        slower meanwhile, so a prompt with `left` seconds to go loses the lesser of left(f-1)
        (it ends within the local prefill) and local_s(1 - 1/f)."""
        added, late, k = 0.0, 0, self.calibration.ttft
        for w, f in ((loads[wid], f) for wid, f in self.coupled.items() if wid in loads):
            for j, left in w.prefill_ends(now):
                extra = min(left * (f - 1), local_s * (1 - 1 / f)) * k
                added, ttft = added + extra, now - j.queued_at + left * k
                late += self.slo_ttft_s is not None and ttft <= self.slo_ttft_s < ttft + extra
        return added, late


def spec_step(
    model: CostModel, step_s: float, spec: tuple[float, float], streams: int, context: int
) -> float:
    """Seconds per token of a decode step on a speculating worker: the step also verifies
    `spec[0]` draft rows per stream (priced as prompt tokens over the stream's context, as the
    stall-free budget prices them) and yields 1 + `spec[1]` tokens per stream."""
    drafts, accepted = spec
    if not drafts:
        return step_s
    rows = max(1, round(drafts * streams))
    verify = model.prefill_s(rows, context) - model.prefill_s(0, 0)
    return (step_s + verify) / (1 + accepted)
