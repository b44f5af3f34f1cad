"""The numbers of one `bench sched` arm: percentiles by label, prediction error, prefix-cache
statistics, later-turn TTFTs, and the arm's summary line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pdserve.bench.load import summary
from pdserve.bench.observe import role_switches
from pdserve.percentiles import percentiles


def by_label(
    samples: Sequence[dict[str, Any]] | None, names: Sequence[str], label: str
) -> dict[str, float] | None:
    """Sum of the samples of the first family in `names` that has any (counter samples may end in
    _total), per value of `label`; None when no family is there."""
    if not samples:
        return None
    for name in names:
        rows = [s for s in samples if s["name"] in (name, f"{name}_total")]
        if rows:
            out: dict[str, float] = {}
            for s in rows:
                k = str(s["labels"].get(label, ""))
                out[k] = out.get(k, 0.0) + float(s["value"])
            return out
    return None


def prediction_error(requests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """|predicted - actual| / actual over requests with a prediction: TTFT and TPOT p50/p90, n;
    actual: the server's (prediction.actual_*) when given, else the client's measurement."""
    out: dict[str, Any] = {"with_prediction": 0}
    errs: dict[str, list[float]] = {"ttft": [], "tpot": []}
    for r in requests:
        pred = r.get("prediction")
        if not isinstance(pred, dict):
            continue
        out["with_prediction"] += 1
        for kind in ("ttft", "tpot"):
            p = pred.get(f"{kind}_s")
            a = pred.get(f"actual_{kind}_s")
            if a is None and r.get(f"{kind}_ms") is not None:
                a = r[f"{kind}_ms"] / 1e3
            if isinstance(p, int | float) and isinstance(a, int | float) and a > 0:
                errs[kind].append(abs(p - a) / a)
    for kind, values in errs.items():
        out[kind] = {**percentiles(values, (50, 90)), "n": len(values)}
    return out


def _routes_from_timelines(requests: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    routes: dict[str, float] = {}
    for r in requests:
        pred = r.get("prediction")
        if isinstance(pred, dict) and pred.get("route"):
            routes[str(pred["route"])] = routes.get(str(pred["route"]), 0.0) + 1
    return routes or None


def prefix_stats(arm: dict[str, Any]) -> dict[str, Any]:
    """Prefix-cache hit rate: the workers' `prefix_cache_hit_rate` (admin rows, or their stats,
    else /metrics gauges named *prefix_cache_hit_rate), mean over workers; router counters whose
    name mentions "prefix" (differences over the load); the share of prompt tokens the router's
    predictions expected cached where it sent the prefill (`cached_prefill_tokens`)."""
    rates: dict[str, float] = {}
    for row in arm.get("workers") or []:
        if not isinstance(row, dict):
            continue
        v = row.get("prefix_cache_hit_rate")
        if v is None and isinstance(row.get("stats"), dict):
            v = row["stats"].get("prefix_cache_hit_rate")
        if isinstance(v, int | float):
            rates[str(row.get("id"))] = float(v)
    if not rates:
        for s in arm.get("metrics") or []:
            if s["name"].endswith("prefix_cache_hit_rate"):
                rates[str(s["labels"].get("worker", len(rates)))] = s["value"]
    counters = {
        s["name"] + _labels(s["labels"]): s["value"]
        for s in arm.get("metrics_delta") or []
        if "prefix" in s["name"] and not s["name"].endswith(("_created", "hit_rate"))
    }
    cached = prompt = 0
    for r in (arm.get("bench") or {}).get("requests") or []:
        pred = r.get("prediction")
        n = r.get("prompt_tokens")
        if isinstance(pred, dict) and isinstance(pred.get("cached_prefill_tokens"), int) and n:
            cached += pred["cached_prefill_tokens"]
            prompt += n
    return {
        "hit_rate_mean": float(np.mean(list(rates.values()))) if rates else None,
        "hit_rate_by_worker": rates or None,
        "counters": counters or None,
        # prompt tokens the router expected cached where it sent the prefill (its predictions)
        "cached_share_predicted": cached / prompt if prompt else None,
    }


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else ""


def turn_ttfts(requests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TTFT p50/p90 of completed turns > 0, pooled and per turn."""
    ok = [r for r in requests if r.get("ttft_ms") is not None and not r.get("rejected")]
    later = [r["ttft_ms"] for r in ok if (r.get("turn") or 0) > 0]
    per_turn: dict[str, dict[str, float | None]] = {}
    for t in sorted({int(r.get("turn") or 0) for r in ok}):
        per_turn[str(t)] = percentiles(
            [r["ttft_ms"] for r in ok if int(r.get("turn") or 0) == t], (50, 90)
        )
    return {"later_turns": {**percentiles(later, (50, 90)), "n": len(later)}, "per_turn": per_turn}


def summarize_arm(arm: dict[str, Any], slo: tuple[float, float]) -> dict[str, Any]:
    """Every number the report shows for one arm, from the arm's raw results alone."""
    res = arm["bench"]
    reqs = res["requests"]
    outcome = summary.outcome_summary(reqs, slo[0], slo[1], res.get("duration_s"))
    done = [r for r in reqs if r.get("error") is None and not r.get("rejected")]
    delta = arm.get("metrics_delta")
    kv = by_label(delta, ["pdserve_kv_transfer_bytes"], "side")
    routes = by_label(delta, ["pdserve_disagg_decisions", "pdserve_route_decisions"], "route")
    switches = role_switches(arm.get("worker_polls") or [])
    return {
        **outcome,
        "ttft_ms": percentiles([r["ttft_ms"] for r in done if r.get("ttft_ms") is not None]),
        "tpot_ms": percentiles([r["tpot_ms"] for r in done if r.get("tpot_ms") is not None]),
        "by_phase": summary.by_phase(reqs, slo[0], slo[1]),
        "server_rejections": by_label(delta, ["pdserve_rejected"], "reason")
        or by_label(delta, ["pdserve_request_rejections"], "code"),
        "routes": routes,
        "routes_source": "metrics" if routes else "timelines",
        "routes_from_timelines": _routes_from_timelines(reqs),
        "kv_bytes_sent": kv.get("send") if kv else None,
        "prefix": prefix_stats(arm),
        "turns": turn_ttfts(reqs),
        "role_switches": switches,
        "role_switches_server": by_label(delta, ["pdserve_role_switches"], "by"),
        "roles_final": {
            str(r.get("id")): r.get("role") for r in arm.get("workers") or [] if isinstance(r, dict)
        }
        or None,
        "prediction_error": prediction_error(reqs),
        "timelines_fetched": res.get("timelines_fetched"),
    }
