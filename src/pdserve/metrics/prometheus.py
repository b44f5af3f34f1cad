"""Prometheus metrics of the router, all named `pdserve_*`, in a registry of their own.

Two sources feed them:

- the RouterCore, which calls `on_request_end(flight, outcome)`, `on_worker_stats(worker,
  stats)`, `on_transfer(report)` and `on_retry(failed)` when `core.metrics` is set;
- the HTTP app, which calls `on_delta(rid, n_tokens)` for every delta it hands a client (so
  inter-token latency is the real gap between deliveries, not an average) and
  `on_rejected(code)` for a request it refuses before it reaches the core.

Latencies use the router's own clock when the app reported deltas (workers on another host have
another clock); the core's timeline stamps are the fallback. Worker gauges and the workers'
cumulative counters (hand-offs, preemptions, lease reclaims, transfer failures) are mirrored from
the last stats each worker sent, labelled by worker and role (which ones: worker_series.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.metrics.worker_series import HANDOFF_STATS, WORKER_COUNTERS, WORKER_GAUGES
from pdserve.router.timeline import Ev

OUTCOMES = ("ok", "rejected", "error", "aborted")
# fmt: off
TTFT_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
    2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
)
TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)
E2E_BUCKETS: tuple[float, ...] = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)
TRANSFER_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
# fmt: on
MAX_TRACKED = 10_000  # in-flight requests whose delta times are kept (a leak guard)
RECENT_KEEP = 4096  # finished requests kept for the dashboard (router/dashboard.py)


@dataclass(frozen=True, slots=True)
class Finished:
    """One finished request as the dashboard shows it (`Metrics.recent`, newest last)."""

    rid: str
    end: float  # time.monotonic() when it ended
    outcome: str  # ok | rejected | error | aborted
    route: str  # remote | local | colocated | fallback | recompute | "" (never dispatched)
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    within_slo: bool  # finished ok within both SLOs (counted in pdserve_requests_within_slo)


@dataclass
class _Stream:
    """Router-clock times of one request's deliveries (from `on_delta`)."""

    first: float | None = None  # first delta carrying tokens
    last: float | None = None  # latest delta carrying tokens


class _WorkerCollector(Collector):
    """Exposes the last stats of every worker as labelled gauges and counters."""

    def __init__(self) -> None:
        self.stats: dict[tuple[str, str], dict[str, Any]] = {}

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> list[Metric]:
        labels = ["worker", "role"]
        out: list[Metric] = []
        for key, (name, doc) in WORKER_GAUGES.items():
            g = GaugeMetricFamily(f"pdserve_{name}", doc, labels=labels)
            for (worker, role), s in self.stats.items():
                if _number(s.get(key)) is not None:
                    g.add_metric([worker, role], _number(s.get(key)))  # type: ignore[arg-type]
            out.append(g)
        for key, (name, doc) in WORKER_COUNTERS.items():
            c = CounterMetricFamily(f"pdserve_{name}", doc, labels=labels)
            for (worker, role), s in self.stats.items():
                c.add_metric([worker, role], _number(s.get(key)) or 0.0)
            out.append(c)
        h = CounterMetricFamily(
            "pdserve_worker_handoffs",
            "KV hand-offs completed: sent (prefill side, acknowledged) or received (decode side).",
            labels=[*labels, "direction"],
        )
        for (worker, role), s in self.stats.items():
            for key, direction in HANDOFF_STATS.items():
                h.add_metric([worker, role, direction], _number(s.get(key)) or 0.0)
        out.append(h)
        f = GaugeMetricFamily(
            "pdserve_worker_prefill_format",
            "1 for the weight format prompt rows run on (bf16 | none) and the matrix "
            "instructions under it (amx | avx512_bf16 | none), chosen at start-up.",
            labels=[*labels, "format", "isa"],
        )
        for (worker, role), s in self.stats.items():
            if isinstance(s.get("prefill_format"), str):
                f.add_metric([worker, role, s["prefill_format"], str(s.get("prefill_isa"))], 1.0)
        out.append(f)
        a = CounterMetricFamily(
            "pdserve_spec_accepted_at_position",
            "Verify steps whose draft at this position (1 = the first) was accepted.",
            labels=[*labels, "position"],
        )
        for (worker, role), s in self.stats.items():
            at = s.get("spec_accepted_at")
            for i, n in enumerate(at if isinstance(at, list) else ()):
                if _number(n) is not None:
                    a.add_metric([worker, role, str(i + 1)], _number(n))  # type: ignore[arg-type]
        out.append(a)
        return out + self._kv_pool_families(labels)

    def _kv_pool_families(self, labels: list[str]) -> list[Metric]:
        """Each worker's KV pool tiers (stats["kv_pool"]["tiers"], kvpool/ `stats()`), under the
        pool's own metric names with a worker label: the router's /metrics and its dashboard
        see every worker's pool (a worker process serves no /metrics of its own)."""
        tiers = {
            key: s["kv_pool"].get("tiers", {})
            for key, s in self.stats.items()
            if isinstance(s.get("kv_pool"), dict)
        }
        if not tiers:
            return []
        lab = [*labels, "tier"]
        hits = CounterMetricFamily(
            "pdserve_kvpool_hit_blocks", "Blocks lookup() found in the tier.", labels=lab
        )
        asked = CounterMetricFamily(
            "pdserve_kvpool_lookup_blocks", "Blocks asked of the tier by lookup().", labels=lab
        )
        used = GaugeMetricFamily("pdserve_kvpool_used_bytes", "Bytes the tier holds.", labels=lab)
        for (worker, role), by_tier in tiers.items():
            for tier, t in by_tier.items():
                key = [worker, role, str(tier)]
                hits.add_metric(key, _number(t.get("hit_blocks")) or 0.0)
                asked.add_metric(key, _number(t.get("lookup_blocks")) or 0.0)
                if _number(t.get("bytes")) is not None:
                    used.add_metric(key, _number(t.get("bytes")))  # type: ignore[arg-type]
        return [hits, asked, used]


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


class Metrics:
    """The router's metrics; `render()` gives the exposition text for GET /metrics."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, *, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> None:
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "pdserve_request_ttft_seconds",
            "Time to first token: arrival at the router to the first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_request_tpot_seconds",
            "Time per output token after the first, per finished request.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_request_itl_seconds",
            "Inter-token latency: the gap between consecutive deliveries of tokens to a client.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_request_e2e_seconds",
            "End-to-end latency of requests that finished normally.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of requests sent to workers.", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens generated and sent to clients.", registry=r
        )
        self.requests = Counter(
            "pdserve_requests",
            "Requests by outcome: ok, rejected (refused before dispatch), error, aborted.",
            ["outcome"],
            registry=r,
        )
        self.rejections = Counter(
            "pdserve_request_rejections",
            "Requests refused by the router before dispatch, by error code.",
            ["code"],
            registry=r,
        )
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV bytes moved between workers.", ["side"], registry=r
        )
        self.transfer_frames = Counter(
            "pdserve_kv_transfer_frames", "KV frames moved between workers.", ["side"], registry=r
        )
        self.transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Duration of one request's KV hand-off, as each side measured it.",
            ["side"],
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "pdserve_retries", "Hand-offs retried after a transfer failure.", registry=r
        )
        self.recomputes = Counter(
            "pdserve_recomputes",
            "Requests whose KV was recomputed instead of transferred.",
            registry=r,
        )
        self.worker_down = Counter(
            "pdserve_worker_down",
            "Workers taken out of routing, by reason (no_heartbeat, stuck).",
            ["reason"],
            registry=r,
        )
        self.recoveries = Counter(
            "pdserve_recoveries",
            "Requests moved to other workers after a worker went down, by how (pair, local, pool: "
            "a D resuming from its KV pool).",
            ["how"],
            registry=r,
        )
        self.slo_violations = Counter(
            "pdserve_slo_violations",
            "Requests that missed a latency SLO, by kind (ttft, tpot).",
            ["kind"],
            registry=r,
        )
        self.within_slo = Counter(
            "pdserve_requests_within_slo",
            "Requests that finished normally within both latency SLOs (rate() = goodput).",
            registry=r,
        )
        self.routes = Counter(
            "pdserve_route_decisions",
            "Dispatches by route: remote (P then D), local (whole on a decode worker), "
            "colocated, fallback (a role's pool empty), recompute (D recomputes the KV), "
            "pool_resume (a dead D's request resumed on another D from its KV pool).",
            ["route"],
            registry=r,
        )
        self.thread_moves = Counter(
            "pdserve_thread_moves",
            "Changes of the P/D thread split on this host (--adaptive), by which pool gained: "
            "prefill, decode.",
            ["to"],
            registry=r,
        )
        self.prediction_error = Histogram(
            "pdserve_prediction_error_ratio",
            "|predicted - actual| / actual of the planner's TTFT and TPOT, per finished request.",
            ["kind"],
            buckets=(0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0),
            registry=r,
        )
        self.role_switches = Counter(
            "pdserve_role_switches",
            "Workers switched between prefill and decode, by who asked (admin, autobalance).",
            ["by"],
            registry=r,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        for side in ("send", "recv"):
            self.transfer_bytes.labels(side)
            self.transfer_frames.labels(side)
            self.transfer_seconds.labels(side)
        for kind in ("ttft", "tpot"):
            self.slo_violations.labels(kind)
        for reason in ("no_heartbeat", "stuck"):
            self.worker_down.labels(reason)
        for how in ("pair", "colocated", "local", "pool"):
            self.recoveries.labels(how)
        self.conversations = Counter(
            "pdserve_conversation_followups",
            "Follow-up turns of conversations, by outcome: hit (the worker keeping the history "
            "had all of it cached), miss (evicted: prefilled again), moved (routed elsewhere).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("hit", "miss", "moved"):
            self.conversations.labels(outcome)
        self.cost_level = Gauge(
            "pdserve_cost_model_level",
            "The planner's step times against the profiled cost model, as `--level-probe` "
            "measured them at start-up (measured / profiled, by kind; 1: not probed).",
            ["kind"],
            registry=r,
        )
        for kind in ("prefill", "decode"):
            self.cost_level.labels(kind).set(1.0)
        self._workers = _WorkerCollector()
        r.register(self._workers)
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        # The dashboard's ring of finished requests: O(1) per request, bounded.
        self.recent: deque[Finished] = deque(maxlen=RECENT_KEEP)

    # ---- exposition ----------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- hooks the HTTP app calls --------------------------------------------------------------
    def on_delta(self, rid: str, n_tokens: int, t: float | None = None) -> None:
        """A delta of `n_tokens` tokens of request `rid` was handed to its client at `t`."""
        if n_tokens <= 0:
            return
        t = time.monotonic() if t is None else t
        s = self._streams.get(rid)
        if s is None:
            s = self._streams[rid] = _Stream()
            while len(self._streams) > MAX_TRACKED:
                self._streams.popitem(last=False)
        if s.last is not None:
            self.itl.observe(max(0.0, t - s.last))
        if s.first is None:
            s.first = t
        s.last = t

    def on_rejected(self, code: str | None = None) -> None:
        """A request refused before it reached the core (bad parameters, too long, ...)."""
        self.requests.labels("rejected").inc()
        self.rejections.labels(code or "unknown").inc()

    def on_refused(self, code: str) -> None:
        """A request the core refused (counted as an outcome when it ends): by reason only."""
        self.rejections.labels(code).inc()

    def on_route(self, route: str) -> None:
        self.routes.labels(route).inc()

    def on_prediction(self, kind: str, rel_error: float) -> None:
        self.prediction_error.labels(kind).observe(rel_error)

    def on_role_switch(self, by: str) -> None:
        self.role_switches.labels(by).inc()

    def on_recompute(self) -> None:
        self.recomputes.inc()

    def on_thread_move(self, to: str) -> None:
        self.thread_moves.labels(to).inc()

    # ---- hooks the RouterCore calls ------------------------------------------------------------
    def on_request_end(self, flight: Any, outcome: str) -> None:
        end = time.monotonic()
        self.requests.labels(outcome if outcome in OUTCOMES else "error").inc()
        n_out = len(flight.sent)
        self.prompt_tokens.inc(len(flight.prompt_ids))
        self.generation_tokens.inc(n_out)
        ttft, tpot = self._latencies(flight, outcome, end, n_out)
        if ttft is not None:
            self.ttft.observe(ttft)
            if self.slo_ttft_s is not None and ttft > self.slo_ttft_s:
                self.slo_violations.labels("ttft").inc()
        if tpot is not None:
            self.tpot.observe(tpot)
            if self.slo_tpot_s is not None and tpot > self.slo_tpot_s:
                self.slo_violations.labels("tpot").inc()
        good = outcome == "ok" and self.meets_slo(ttft, tpot)
        if good:
            self.within_slo.inc()
        route = str(getattr(flight, "route", "") or "")
        n_in = len(flight.prompt_ids)
        self.recent.append(Finished(flight.rid, end, outcome, route, n_in, n_out, ttft, tpot, good))

    def meets_slo(self, ttft: float | None, tpot: float | None) -> bool:
        """Within both SLOs (an SLO not set is met; a request of one token has no TPOT)."""
        ttft_ok = self.slo_ttft_s is None or (ttft is not None and ttft <= self.slo_ttft_s)
        return ttft_ok and (self.slo_tpot_s is None or tpot is None or tpot <= self.slo_tpot_s)

    def _latencies(
        self, flight: Any, outcome: str, end: float, n_out: int
    ) -> tuple[float | None, float | None]:
        """(TTFT, TPOT) of a finished request (TPOT only when it finished normally); observes
        the end-to-end latency of a normal finish."""
        stream = self._streams.pop(flight.rid, None)
        events: dict[str, float] = {}
        for event, _worker, t in flight.timeline:
            events.setdefault(event, t)
        arrive = events.get(Ev.ARRIVE)
        first: float | None
        last: float | None
        if stream is not None and stream.first is not None:
            first, last = stream.first, stream.last or stream.first
        else:  # no deltas reported by an app: the core's own stamps
            first, last = events.get(Ev.FIRST_TOKEN), end
        if arrive is None:
            return None, None
        ttft = max(0.0, first - arrive) if first is not None else None
        if outcome != "ok":
            return ttft, None
        self.e2e.observe(max(0.0, end - arrive))
        if first is not None and last is not None and n_out > 1:
            return ttft, max(0.0, last - first) / (n_out - 1)
        return ttft, None

    def on_worker_stats(self, worker: Any, stats: dict[str, Any]) -> None:
        self._workers.stats[(str(worker.worker_id), str(worker.role))] = dict(stats)

    def on_transfer(self, report: Any) -> None:
        side = str(report.side)
        self.transfer_bytes.labels(side).inc(max(0, int(report.nbytes)))
        self.transfer_frames.labels(side).inc(max(0, int(report.frames)))
        self.transfer_seconds.labels(side).observe(max(0.0, float(report.seconds)))

    def on_retry(self, failed: Any) -> None:
        self.retries.inc()

    def on_worker_down(self, worker: Any, reason: str) -> None:
        self.worker_down.labels(reason).inc()

    def on_recovery(self, how: str) -> None:
        self.recoveries.labels(how).inc()

    def on_conversation(self, outcome: str) -> None:
        self.conversations.labels(outcome).inc()
