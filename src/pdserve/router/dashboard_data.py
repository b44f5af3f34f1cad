"""The dashboard's numbers (router/dashboard.py), computed from what the router keeps: latency
quantiles and goodput over the finished requests of the last minute (`window_point`), a request's
stages from its public timeline (`segments`), the totals and the KV pool's tiers read out of the
metrics registry (`registry_samples`, `totals`, `kv_pool`), and one worker's row (`worker_row`).
Pure functions of their arguments, tested without an app.

The KV-pool panel appears only when the registry has the pool's `pdserve_kvpool_*{tier=...}`
metrics (kvpool/metrics.py): per tier, the hit rate is hit_blocks / lookup_blocks summed over
every pool reporting (the `pdserve_kvpool_hit_rate` gauge when only it is there) and the bytes
are `pdserve_kvpool_used_bytes` summed - except the shared Redis tier, which every worker
reports whole (its max is taken).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, Literal

from pdserve.percentiles import percentiles
from pdserve.router.timeline import Ev, Stage

WINDOW_S = 60.0  # "the last minute" of the latency quantiles and goodput
KVPOOL_SERIES = (
    "pdserve_kvpool_hit_blocks_total",
    "pdserve_kvpool_lookup_blocks_total",
    "pdserve_kvpool_hit_rate",
    "pdserve_kvpool_used_bytes",
)
SHARED_TIERS = ("redis",)  # one server behind every worker: each reports all of it
DEGRADED_HEARTBEAT_S = 1.5  # older than 3 heartbeats (0.5 s), not yet down (2 s): degraded

State = Literal["ready", "draining", "down", "degraded"]


# ---- the window, segments ----------------------------------------------------------------------
def window_point(recent: Sequence[Any], now: float, t_unix: float) -> dict[str, Any]:
    """The series point at `now` (monotonic) over the finished requests of the last WINDOW_S
    (`recent`: `Finished` records, oldest first; walked from the newest, so O(window))."""
    ttfts, tpots, ok, good, n = [], [], 0, 0, 0
    for f in reversed(recent):
        if f.end > now:
            continue
        if f.end < now - WINDOW_S:
            break
        n += 1
        if f.ttft_s is not None:
            ttfts.append(f.ttft_s)
        if f.tpot_s is not None:
            tpots.append(f.tpot_s)
        ok += f.outcome == "ok"
        good += f.within_slo
    ttft, tpot = percentiles(ttfts, (50, 90)), percentiles(tpots, (50, 90))
    return {
        "t": round(t_unix, 3),
        "n": n,
        "ttft_p50": rounded(ttft["p50"]),
        "ttft_p90": rounded(ttft["p90"]),
        "tpot_p50": rounded(tpot["p50"]),
        "tpot_p90": rounded(tpot["p90"]),
        "goodput_rps": round(good / WINDOW_S, 4),
        "throughput_rps": round(ok / WINDOW_S, 4),
    }


def rounded(v: float | None, nd: int = 6) -> float | None:
    return None if v is None else round(v, nd)


def segments(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Queue / prefill / transfer / decode spans (ms from arrival) of a public timeline
    (`core.timeline(rid)`); a stage whose stamps are missing is left out."""
    first: dict[str, tuple[float, str]] = {}
    for e in events:
        first.setdefault(e["event"], (float(e["t_ms"]), str(e["worker"])))
    end = max((float(e["t_ms"]) for e in events), default=0.0)
    ps = first.get(Stage.PREFILL_START)
    pe = first.get(Stage.PREFILL_END) or first.get(Ev.FIRST_TOKEN)
    ts, te = first.get(Stage.TRANSFER_START), first.get(Stage.TRANSFER_END)
    out: list[dict[str, Any]] = []

    def add(stage: str, a: float, b: float, worker: str | None) -> None:
        if b >= a:
            out.append({"stage": stage, "worker": worker, "start_ms": a, "end_ms": b})

    start_of_work = ps or pe
    if start_of_work is not None:
        add("queue", 0.0, start_of_work[0], start_of_work[1])
    if ps is not None and pe is not None:
        add("prefill", ps[0], pe[0], ps[1])
    if ts is not None and te is not None:
        add("transfer", ts[0], te[0], te[1])
    decode_from = te or pe
    if decode_from is not None:
        decoder = first.get("decode_first_token") or te or pe
        add("decode", decode_from[0], end, decoder[1] if decoder else None)
    return out


# ---- reading the metrics registry --------------------------------------------------------------
def registry_samples(registry: Any) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] of everything in a prometheus_client registry."""
    out: dict[str, list[tuple[dict[str, str], float]]] = collections.defaultdict(list)
    for family in registry.collect():
        for s in family.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return out


def _by(samples: dict, name: str, label: str) -> dict[str, float]:
    return {labels.get(label, ""): v for labels, v in samples.get(name, [])}


def _one(samples: dict, name: str) -> float:
    return sum(v for _labels, v in samples.get(name, []))


def totals(samples: dict) -> dict[str, Any]:
    return {
        "requests": _by(samples, "pdserve_requests_total", "outcome"),
        "rejections": _by(samples, "pdserve_request_rejections_total", "code"),
        "routes": _by(samples, "pdserve_route_decisions_total", "route"),
        "kv_transfer_bytes": _by(samples, "pdserve_kv_transfer_bytes_total", "side"),
        "retries": _one(samples, "pdserve_retries_total"),
        "recomputes": _one(samples, "pdserve_recomputes_total"),
        "role_switches": _by(samples, "pdserve_role_switches_total", "by"),
        "thread_moves": _by(samples, "pdserve_thread_moves_total", "to"),
        "worker_down": _by(samples, "pdserve_worker_down_total", "reason"),
        "prompt_tokens": _one(samples, "pdserve_prompt_tokens_total"),
        "generation_tokens": _one(samples, "pdserve_generation_tokens_total"),
    }


def kv_pool(samples: dict) -> list[dict[str, Any]] | None:
    """Per-tier hit rate and bytes, when a KV pool exports `pdserve_kvpool_*{tier}`."""
    sums: dict[str, dict[str, float]] = {}
    counts: dict[tuple[str, str], int] = collections.Counter()
    for name in KVPOOL_SERIES:
        for labels, v in samples.get(name, []):
            tier = labels.get("tier")
            if tier is None:
                continue
            acc = sums.setdefault(tier, {})
            shared = tier in SHARED_TIERS and name == "pdserve_kvpool_used_bytes"
            acc[name] = max(acc.get(name, v), v) if shared else acc.get(name, 0.0) + v
            counts[tier, name] += 1
    out = []
    for tier, acc in sums.items():
        hits, asked = (
            acc.get("pdserve_kvpool_hit_blocks_total", 0.0),
            acc.get("pdserve_kvpool_lookup_blocks_total"),
        )
        rate = acc.get("pdserve_kvpool_hit_rate")
        if asked:
            hit_rate: float | None = hits / asked
        else:  # only the gauge (or nothing asked yet): its mean over the pools reporting it
            hit_rate = None if rate is None else rate / counts[tier, "pdserve_kvpool_hit_rate"]
        out.append({"tier": tier, "hit_rate": hit_rate, "bytes": acc.get(KVPOOL_SERIES[3])})
    return out or None


def worker_row(row: dict[str, Any], vitals: dict[str, Any]) -> dict[str, Any]:
    stats = vitals.get("stats") or {}
    hb = vitals.get("heartbeat_age_s")
    used, total = int(row.get("kv_blocks_used") or 0), int(row.get("kv_blocks_total") or 0)
    state: State
    if not row.get("healthy"):
        state = "down"
    elif row.get("draining"):
        state = "draining"
    elif hb is not None and hb > DEGRADED_HEARTBEAT_S:
        state = "degraded"
    else:
        state = "ready"
    batch, threads = stats.get("batch_requests"), row.get("threads")
    hit = stats.get("prefix_cache_hit_rate")
    return {
        "id": str(row["id"]),
        "role": str(row.get("role")),
        "state": state,
        "down_reason": row.get("down_reason"),
        "pid": row.get("pid"),
        "threads": int(threads) if isinstance(threads, int | float) else None,
        "batch": int(batch) if isinstance(batch, int | float) else None,
        "queue": int(row.get("queue") or 0),
        "running": int(row.get("running") or 0),
        "outstanding": int(row.get("outstanding") or 0),
        "kv_blocks_used": used,
        "kv_blocks_total": total,
        "kv_use": round(used / total, 4) if total else None,
        "prefix_hit_rate": float(hit) if isinstance(hit, int | float) else None,
        "heartbeat_age_s": hb,
        "loop_age_s": row.get("loop_age_s"),
    }
