"""The validation's tables (sim/validate.py): relative errors, per configuration and per run,
beside the real system's own A/A spread; per-request rows where real and simulated part."""

from __future__ import annotations

from typing import Any

from pdserve.sim.deploy import meets
from pdserve.sim.records import Record

METRICS = (("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90"))


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Relative error per metric ((sim - real) / real) and the attainment gap in points."""
    out: dict[str, Any] = {}
    for metric, q in METRICS:
        a, b = real[metric][q], sim[metric][q]
        out[f"{metric[:4]}_{q}_err"] = None if not a or b is None else (b - a) / a
    out["attainment_diff_pts"] = 100 * (sim["attainment"] - real["attainment"])
    return out


def side_by_side(
    real: list[Record], sim: list[Record], slo_ttft: float | None, slo_tpot: float | None
) -> list[dict[str, Any]]:
    """Per request, the first real run and the simulation: where the two part (a route, a
    request that meets its SLOs in one and not the other) shows which requests to look at."""
    by_rid = {r.rid: r for r in sim}
    rows = []
    for a in real:
        b = by_rid.get(a.rid)
        row: dict[str, Any] = {"rid": a.rid, "arrival": round(a.arrival, 4)}
        for side, r in (("real", a), ("sim", b)):
            if r is None:
                continue
            row[side] = {
                "route": r.route,
                "ttft": None if r.ttft is None else round(r.ttft, 4),
                "tpot": None if r.tpot is None else round(r.tpot, 5),
                "rejected": r.rejected,
                "meets": meets(r, slo_ttft, slo_tpot),
            }
        rows.append(row)
    return rows


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:+.0%}"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1e3:.0f}"


def report(results: list[dict[str, Any]]) -> str:
    """Per configuration and metric: real, sim, errors (sim with contention, independent,
    at the run's own level) and the A/A spread (the configuration's own, else the first one's)."""
    first_aa = next((r["aa"] for r in results if "aa" in r), None)
    lines = [
        "| config | metric | real | sim | err | err independent | err at run level | A/A |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        aa = r.get("aa", first_aa) or {}
        own = "" if "aa" in r else " (first config's)"
        for metric, q in METRICS:
            key = f"{metric[:4]}_{q}_err"
            lines.append(
                f"| {r['case']} | {metric[:4].upper()} {q} ms | {_ms(r['real'][0][metric][q])} "
                f"| {_ms(r['sim'][metric][q])} | {_pct(r['vs'][key])} "
                f"| {_pct(r['vs_independent'][key])} | {_pct(r['vs_calibrated'][key])} "
                f"| {_pct(aa.get(key))}{own if aa else ''} |"
            )
        gap = "attainment_diff_pts"
        lines.append(
            f"| {r['case']} | attainment | {r['real'][0]['attainment']:.0%} "
            f"| {r['sim']['attainment']:.0%} | {r['vs'][gap]:+.0f} pts "
            f"| {r['vs_independent'][gap]:+.0f} pts | {r['vs_calibrated'][gap]:+.0f} pts "
            f"| {(f'{aa[gap]:+.0f} pts' + own) if aa else '—'} |"
        )
    return "\n".join(lines)


def report_runs(results: list[dict[str, Any]]) -> str:
    """At the run's own level, every real run against its own simulation: the level moves
    from run to run, and each run is simulated at its own."""
    lines = [
        "| config | run | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | attainment real / sim "
        "| level prefill / decode |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for i, (real, cal) in enumerate(zip(r["real"], r["calibrated"], strict=True)):
            vs, f = compare(real, cal["sim"]), cal["factors"]
            errs = " | ".join(_pct(vs[f"{m[:4]}_{q}_err"]) for m, q in METRICS)
            lines.append(
                f"| {r['case']} | {i + 1} | {errs} | {real['attainment']:.1%} / "
                f"{cal['sim']['attainment']:.1%} ({vs['attainment_diff_pts']:+.1f} pts) "
                f"| {f['prefill_x']:.2f} / {f['decode_x']:.2f} |"
            )
    return "\n".join(lines)
