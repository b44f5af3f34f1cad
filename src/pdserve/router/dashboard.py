"""The live dashboard: `GET /dashboard` (a static page) and `GET /admin/dashboard.json` (its data).

Everything here reads state the router already keeps — `core.worker_table()`,
`core.worker_vitals()`, `core.timeline(rid)`, `core.prediction(rid)`, `core.counters` and the
metrics (`Metrics.registry`, `Metrics.recent`: the bounded ring of finished requests that
`on_request_end` appends to) — so the request path does no extra work for it.

Two things are derived over time by `Dashboard.sample()` (from a background task while the app
runs, and from the JSON endpoint itself): the latency series (p50 and p90 of TTFT and TPOT over
the last minute, goodput; a point per `SAMPLE_S`) and the worker events (role switches,
restarts, down/up, draining), found by comparing the worker table with the last look (every
`WATCH_S`); a change undone between two looks still shows, from `core.counters`, without a
worker name.
A snapshot is built at most once per `CACHE_S` however many pages poll; the schema of the JSON
is the pydantic model `Snapshot` (tests validate against it).

The numbers themselves (quantiles, segments, totals, the KV-pool panel, a worker's row) are
computed in dashboard_data.py.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import time
from collections.abc import Sequence
from importlib import resources
from typing import Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel

from pdserve.router.dashboard_data import (
    WINDOW_S,
    State,
    kv_pool,
    registry_samples,
    rounded,
    segments,
    totals,
    window_point,
    worker_row,
)

log = logging.getLogger("pdserve.router.dashboard")

SAMPLE_S = 1.0  # how often a point is added to the latency series
WATCH_S = 0.25  # how often the worker table is compared with the last look (events)
WATCHED_COUNTERS = ("role_switches_", "workers_down", "workers_up")  # core.counters
CACHE_S = 0.5  # a snapshot is shared by every poll within this long
SERIES_KEEP = 600  # series points kept (10 minutes at 1 s)
EVENTS_KEEP = 200  # worker events kept
WATERFALL_N = 30  # requests in the waterfall


# ---- the JSON schema ---------------------------------------------------------------------------
class WorkerRow(BaseModel):
    id: str
    role: str
    state: State
    down_reason: str | None
    pid: int | None
    threads: int | None  # torch threads it runs its steps on (moved under --adaptive)
    batch: int | None  # requests in its last engine step
    queue: int
    running: int
    outstanding: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_use: float | None  # used / total
    prefix_hit_rate: float | None
    heartbeat_age_s: float | None
    loop_age_s: float | None


class WorkerEvent(BaseModel):
    t: float  # unix seconds
    worker: str
    kind: Literal["role_switch", "restart", "down", "up", "draining", "joined"]
    detail: str


class SeriesPoint(BaseModel):
    t: float  # unix seconds
    n: int  # requests that finished in the window before t
    ttft_p50: float | None
    ttft_p90: float | None
    tpot_p50: float | None
    tpot_p90: float | None
    goodput_rps: float  # requests/s that finished ok within both SLOs, over the window
    throughput_rps: float  # requests/s that finished ok, over the window


class Segment(BaseModel):
    stage: Literal["queue", "prefill", "transfer", "decode"]
    worker: str | None
    start_ms: float
    end_ms: float


class RequestRow(BaseModel):
    id: str
    t: float  # unix seconds when it ended
    outcome: str
    route: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    predicted_ttft_s: float | None
    predicted_tpot_s: float | None
    total_ms: float | None
    segments: list[Segment]


class PendingWorker(BaseModel):  # a worker the deployment cannot place yet (ray/pending.py)
    worker: str
    role: str
    reason: str  # "pending: needs CPU 1.0, 0 free"


class KVTier(BaseModel):
    tier: str
    hit_rate: float | None
    bytes: float | None


class Totals(BaseModel):
    requests: dict[str, float]  # by outcome
    rejections: dict[str, float]  # by reason (error code)
    routes: dict[str, float]  # by route
    kv_transfer_bytes: dict[str, float]  # by side
    retries: float
    recomputes: float
    role_switches: dict[str, float]  # by who asked
    thread_moves: dict[str, float]  # changes of the P/D thread split, by the pool that gained
    worker_down: dict[str, float]  # by reason
    prompt_tokens: float
    generation_tokens: float


class Snapshot(BaseModel):
    object: Literal["dashboard.snapshot"]
    t: float  # unix seconds
    window_s: float
    refresh_s: float
    slo: dict[str, float | None]  # ttft_s, tpot_s
    workers: list[WorkerRow]
    events: list[WorkerEvent]
    now: SeriesPoint
    series: list[SeriesPoint]
    totals: Totals
    requests: list[RequestRow]
    kv_pool: list[KVTier] | None  # None: no KV-pool metrics (the panel stays hidden)
    pending: list[PendingWorker] = []  # from the scaler (router/pools.py), when there is one


# ---- the dashboard -----------------------------------------------------------------------------
class Dashboard:
    """The dashboard's memory: a series of latency points and a log of worker events, both
    bounded, and the last snapshot (shared by the polls of every open page)."""

    def __init__(self, core: Any, metrics: Any, scaler: Any = None) -> None:
        self.core, self.metrics, self.scaler = core, metrics, scaler
        self.series: collections.deque[dict[str, Any]] = collections.deque(maxlen=SERIES_KEEP)
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=EVENTS_KEEP)
        self._last_sample = self._last_watch = -1e18
        self._workers: dict[str, dict[str, Any]] = {}
        self._counts: dict[str, int] | None = None  # None: no look yet
        self._cached: tuple[float, bytes] | None = None
        self.last_point: dict[str, Any] = {}  # the newest series point: "now" in snapshots

    @property
    def slo(self) -> dict[str, float | None]:
        m = self.metrics
        return {
            "ttft_s": getattr(m, "slo_ttft_s", None) if m is not None else None,
            "tpot_s": getattr(m, "slo_tpot_s", None) if m is not None else None,
        }

    def _recent(self) -> Sequence[Any]:
        recent = getattr(self.metrics, "recent", None)
        return recent if recent is not None else ()

    # ---- sampling -----------------------------------------------------------------------------
    def sample(self, now: float | None = None, force: bool = False) -> None:
        """Add a series point at most once per SAMPLE_S; look at the workers at most once per
        WATCH_S."""
        now = time.monotonic() if now is None else now
        t_unix = time.time() - (time.monotonic() - now)
        if force or now - self._last_watch >= WATCH_S:
            self._last_watch = now
            self._watch_workers(t_unix)
        if force or now - self._last_sample >= SAMPLE_S:
            self._last_sample = now
            self.last_point = window_point(self._recent(), now, t_unix)
            self.series.append(self.last_point)

    def _watch_workers(self, t: float) -> None:
        counters = getattr(self.core, "counters", {}) or {}
        counts = {k: int(v) for k, v in counters.items() if k.startswith(WATCHED_COUNTERS)}
        grew = {k: v - (self._counts or {}).get(k, 0) for k, v in counts.items()}
        first_look = self._counts is None
        grew = {} if first_look else {k: n for k, n in grew.items() if n > 0}
        self._counts = counts
        by = [k.removeprefix("role_switches_") for k in grew if k.startswith("role_switches_")]
        rows = {r["id"]: r for r in self.core.worker_table()}
        seen: collections.Counter[str] = collections.Counter()
        for wid, row in rows.items():
            old = self._workers.get(wid)
            if old is None:
                if not first_look:  # a worker that appeared
                    self._event(t, wid, "joined", f"as {row.get('role')}")
                continue
            seen.update(self._compare(t, wid, old, row, by))
        self._workers = rows
        self._unseen(t, grew, seen)

    def _unseen(self, t: float, grew: dict[str, int], seen: collections.Counter[str]) -> None:
        """Changes the counters show but the worker table no longer does (a switch there and
        back, a blip of an outage between two looks): logged without a worker."""
        switches = sum(n for k, n in grew.items() if k.startswith("role_switches_"))
        for kind, n in (
            ("role_switch", switches),
            ("down", grew.get("workers_down", 0)),
            ("up", grew.get("workers_up", 0)),
        ):
            if n > seen[kind]:
                what = "between two looks at the workers"
                self._event(t, "?", kind, f"{n - seen[kind]} {what} (counted, not seen)")

    def _compare(
        self, t: float, wid: str, old: dict[str, Any], row: dict[str, Any], by: list[str]
    ) -> list[str]:
        """Log what changed on one worker since the last look; returns the kinds logged."""
        kinds = []
        if row.get("role") != old.get("role"):
            who = f" by {', '.join(by)}" if by else ""
            kinds.append(("role_switch", f"{old.get('role')} -> {row.get('role')}{who}"))
        if row.get("pid") is not None and old.get("pid") not in (None, row.get("pid")):
            kinds.append(("restart", f"pid {old.get('pid')} -> {row.get('pid')}"))
        if old.get("healthy") and not row.get("healthy"):
            kinds.append(("down", str(row.get("down_reason") or "unhealthy")))
        if not old.get("healthy") and row.get("healthy"):
            kinds.append(("up", "back in routing"))
        if row.get("draining") and not old.get("draining"):
            kinds.append(("draining", "out of routing until its requests finish"))
        for kind, detail in kinds:
            self._event(t, wid, kind, detail)
        return [kind for kind, _ in kinds]

    def _event(self, t: float, worker: str, kind: str, detail: str) -> None:
        self.events.append({"t": round(t, 3), "worker": worker, "kind": kind, "detail": detail})

    async def run(self) -> None:
        """Sample for as long as the app runs (events are caught while nobody watches)."""
        while True:
            try:
                self.sample()
            except Exception:  # a bug here must not end the sampling (nor touch serving)
                log.exception("dashboard sample failed")
            await asyncio.sleep(WATCH_S)

    # ---- the snapshot -------------------------------------------------------------------------
    def snapshot_bytes(self, now: float | None = None) -> bytes:
        now = time.monotonic() if now is None else now
        if self._cached is not None and now - self._cached[0] < CACHE_S:
            return self._cached[1]
        body = json.dumps(self.snapshot(now), separators=(",", ":")).encode()
        self._cached = (now, body)
        return body

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        self.sample(now)
        t_unix = time.time() - (time.monotonic() - now)
        recent = self._recent()
        samples = registry_samples(self.metrics.registry) if self.metrics is not None else {}
        return {
            "object": "dashboard.snapshot",
            "t": round(t_unix, 3),
            "window_s": WINDOW_S,
            "refresh_s": SAMPLE_S,
            "slo": self.slo,
            "workers": self.workers(),
            "events": list(self.events),
            "now": self.last_point,  # at most SAMPLE_S old, computed once however many poll
            "series": list(self.series),
            "totals": totals(samples),
            "requests": self.requests(recent, now, t_unix),
            "kv_pool": kv_pool(samples),
            "pending": self.scaler.status().get("pending", []) if self.scaler else [],
        }

    def workers(self) -> list[dict[str, Any]]:
        vitals_of = getattr(self.core, "worker_vitals", None)
        vitals = vitals_of() if vitals_of is not None else {}
        return [worker_row(r, vitals.get(r["id"], {})) for r in self.core.worker_table()]

    def requests(self, recent: Sequence[Any], now: float, t_unix: float) -> list[dict[str, Any]]:
        out = []
        predicted_of = getattr(self.core, "prediction", None)
        for f in itertools.islice(reversed(recent), WATERFALL_N):  # newest first
            events = self.core.timeline(f.rid) or []
            pred = (predicted_of(f.rid) if predicted_of is not None else None) or {}
            total = max((float(e["t_ms"]) for e in events), default=None)
            out.append(
                {
                    "id": f.rid,
                    "t": round(t_unix - (now - f.end), 3),
                    "outcome": f.outcome,
                    "route": f.route or pred.get("route") or "",
                    "prompt_tokens": f.prompt_tokens,
                    "output_tokens": f.output_tokens,
                    "ttft_s": rounded(f.ttft_s),
                    "tpot_s": rounded(f.tpot_s),
                    "predicted_ttft_s": pred.get("ttft_s"),
                    "predicted_tpot_s": pred.get("tpot_s"),
                    "total_ms": total,
                    "segments": segments(events),
                }
            )
        return out


def page() -> bytes:
    """The dashboard page (one self-contained file: inline CSS and JS, no external requests)."""
    return resources.files("pdserve.router").joinpath("static/dashboard.html").read_bytes()


# ---- the routes --------------------------------------------------------------------------------
PAGE_PATH = "/dashboard"  # open: static code, no data; the data below needs the API key
JSON_PATH = "/admin/dashboard.json"


def mount(app: Any, board: Dashboard) -> None:
    """Add the dashboard's two read-only routes to the router's FastAPI app."""
    html = page()

    @app.get(PAGE_PATH, include_in_schema=False, response_model=None)
    async def dashboard_page() -> Response:
        # no-store: a new router version is never shown with an old page's code
        return Response(html, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @app.get(JSON_PATH, response_model=None)
    async def dashboard_json() -> Response:
        return Response(
            board.snapshot_bytes(),
            media_type="application/json",
            headers={"Cache-Control": "no-store"},
        )


# The page may load nothing from anywhere but this router, inline code included.
PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'none'; connect-src 'self'; img-src 'self' data:; "
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
}


def lifespan(board: Dashboard) -> Any:
    """The app's lifespan: sample in the background while the app runs."""
    import contextlib

    @contextlib.asynccontextmanager
    async def span(_app: Any) -> Any:
        task = asyncio.create_task(board.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return span
