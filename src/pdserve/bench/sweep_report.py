"""The report of `pdserve bench sweep`: each curve's knee, the points' spread over repeats, the
summary JSON, report.md and the plot (goodput and SLO attainment against the request rate, one
line per system, the simulator's predictions dashed beside the measured lines).

The knee of a curve is the request rate at which its SLO attainment falls below the threshold
(`--knee-attainment`, default 0.9): walking up the measured rates, the first point below the
threshold and the point before it bracket it, and the knee is interpolated linearly between
them. When every point is at or above the threshold the knee is at least the highest rate
measured ("at_least"); when the lowest rate is already below it, there is none ("below_all").
A curve of repeats uses each rate's median attainment.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.harness import plots, report

SPREAD_KEYS = ("goodput", "attainment")  # per point: median, min, max over the repeats
LEVELLED = ("levelled", "stepped")  # the simulator's points at the probed / the steps' level


@dataclass(frozen=True)
class Knee:
    rate: float | None  # req/s; None: below the threshold at every measured rate
    kind: str  # "interpolated", "at_least" (every point meets it) or "below_all"
    threshold: float

    def text(self) -> str:
        if self.rate is None:
            return f"none (attainment < {self.threshold:.0%} at every rate)"
        if self.kind == "at_least":
            return f">= {self.rate:g} req/s (every rate >= {self.threshold:.0%})"
        return f"{self.rate:.3g} req/s"


def knee(points: Sequence[tuple[float, float]], threshold: float) -> Knee:
    """The knee of a curve of (rate, attainment) points (any order): see the module doc."""
    if not points:
        raise ValueError("a knee needs at least one point")
    if not 0 < threshold <= 1:
        raise ValueError(f"the knee's attainment threshold must be in (0, 1], got {threshold}")
    ordered = sorted(points)
    if ordered[0][1] < threshold:
        return Knee(None, "below_all", threshold)
    for (r0, a0), (r1, a1) in itertools.pairwise(ordered):
        if a1 < threshold:
            return Knee(r0 + (a0 - threshold) / (a0 - a1) * (r1 - r0), "interpolated", threshold)
    return Knee(ordered[-1][0], "at_least", threshold)


def knee_error(predicted: Knee, measured: Knee) -> float | None:
    """(predicted - measured) / measured, when both knees were located (interpolated)."""
    if predicted.kind != "interpolated" or measured.kind != "interpolated":
        return None
    assert predicted.rate is not None and measured.rate is not None
    return (predicted.rate - measured.rate) / measured.rate


def spread(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median, min and max over the repeats of a point, for goodput and attainment."""
    out = {}
    for key in SPREAD_KEYS:
        values = [float(r[key]) for r in runs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def curve(points: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """(rate, median attainment) of a system's measured points."""
    return [(p["rate"], p["spread"]["attainment"]["median"]) for p in points if p.get("runs")]


def summarize(result: dict[str, Any], threshold: float) -> dict[str, Any]:
    """Per system: its knee, and the simulator's knee and error where predicted."""
    out: dict[str, Any] = {}
    for s in result["systems"]:
        row: dict[str, Any] = {"skipped": s.get("skipped")}
        points = curve(s.get("points", []))
        measured = knee(points, threshold) if points else None
        row["knee"] = asdict(measured) if measured else None
        sim = s.get("sim")
        if sim and sim.get("points"):
            predicted = knee([(p["rate"], p["attainment"]) for p in sim["points"]], threshold)
            row["sim_knee"] = asdict(predicted)
            row["sim_knee_error"] = knee_error(predicted, measured) if measured else None
            for key in LEVELLED:  # at the probed level, at the points' own steps' level
                if sim.get(key):
                    at = knee([(p["rate"], p["attainment"]) for p in sim[key]], threshold)
                    row[f"{key}_knee"] = asdict(at)
                    row[f"{key}_knee_error"] = knee_error(at, measured) if measured else None
        elif sim:
            row["sim_skipped"] = sim.get("skipped")
        out[s["name"]] = row
    return out


# ---------------------------------------------------------------------------- markdown


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.0%}"


def _num(v: float | None, fmt: str = ".3f") -> str:
    return "—" if v is None else format(v, fmt)


def _point_row(name: str, p: dict[str, Any], sim: dict[float, str]) -> list[str]:
    predicted = sim.get(p["rate"], "—")
    if not p.get("runs"):
        why = (str(p.get("failed", "")).splitlines() or [""])[0]  # the log's tail: in the JSON
        return [name, f"{p['rate']:g}", f"failed: {why}", "—", predicted,
                *["—"] * 6]  # fmt: skip
    g, a = p["spread"]["goodput"], p["spread"]["attainment"]
    return [
        name, f"{p['rate']:g}", f"{_num(g['median'])} ({_num(g['min'])}-{_num(g['max'])})",
        f"{_pct(a['median'])} ({_pct(a['min'])}-{_pct(a['max'])})", predicted,
        _num(p["ttft_ms"]["p90"], ".0f"), _num(p["tpot_ms"]["p90"], ".1f"),
        str(p["completed"]), str(p.get("refused", "—")), str(p["failed"]), str(len(p["runs"])),
    ]  # fmt: skip


def _sim_attainment(system: dict[str, Any]) -> dict[float, str]:
    """Per rate: the predicted attainment, then at the probed level and at the steps' level,
    each with its factors."""
    sim = system.get("sim") or {}
    out = {q["rate"]: _pct(q["attainment"]) for q in sim.get("points") or []}
    for key in LEVELLED:
        for q in sim.get(key) or []:
            out[q["rate"]] = (f"{out.get(q['rate'], '—')} / {_pct(q['attainment'])} "
                              f"(x{q['prefill_x']:.2f}/x{q['decode_x']:.2f})")  # fmt: skip
    return out


def _knee_lines(result: dict[str, Any]) -> list[str]:
    rows = []
    for name, k in result["summary"].items():
        if k.get("skipped"):
            rows.append([name, f"skipped: {k['skipped']}", *["—"] * 6])
            continue
        measured = Knee(**k["knee"]).text() if k.get("knee") else "—"
        sim = Knee(**k["sim_knee"]).text() if k.get("sim_knee") else k.get("sim_skipped") or "—"
        row = [name, measured, sim, _err(k.get("sim_knee_error"))]
        for key in LEVELLED:
            at = k.get(f"{key}_knee")
            row += [Knee(**at).text() if at else "—", _err(k.get(f"{key}_knee_error"))]
        rows.append(row)
    header = ("system", "knee (measured)", "knee (simulated)", "error",
              "simulated at the probed level", "error",
              "at the points' own steps", "error")  # fmt: skip
    return report.markdown_table(header, rows)


def _err(v: float | None) -> str:
    return "—" if v is None else f"{v:+.0%}"


def render(result: dict[str, Any]) -> str:
    slo, thr = result["slo"], result["knee_attainment"]
    lines = [
        "# bench sweep: goodput and SLO attainment against the request rate",
        "",
        f"- date: {result['started']}",
        f"- command: `{result['command']}`",
        f"- machine: {result['machine'].get('cpu')}, {result['machine'].get('cores')} cores, "
        f"load average {report.load_span(result['machine'])} (start/end)",
        f"- workload: {result['workload']}",
        f"- SLOs: TTFT <= {slo['ttft_s']:g} s, TPOT <= {slo['tpot_s']:g} s",
        f"- point order: {result['order']}; repeats per point: {result['repeats']}",
        *_simulated_line(result),
        f"- knee: the rate where SLO attainment falls below {thr:.0%}, interpolated between the "
        "two measured rates that bracket it (median over repeats)",
        "",
        "## Knees",
        "",
        *_knee_lines(result),
        "",
        "## Points (median over repeats, min-max in brackets; latencies and counts of the "
        "median run; sim: the simulator's attainment with the profile / at the host's level "
        "probed before the point / at the level of the point's own steps (each with its prefill "
        "/ decode factors against the profile))",
        "",
    ]
    header = ("system", "rate", "goodput req/s", "attainment", "sim", "TTFT p90 ms",
              "TPOT p90 ms", "completed", "refused", "failed", "runs")  # fmt: skip
    rows = [
        _point_row(s["name"], p, _sim_attainment(s))
        for s in result["systems"]
        for p in s.get("points", [])
    ]
    lines += report.markdown_table(header, rows, "llrrrrrrrrr")
    return "\n".join(lines) + "\n"


def _simulated_line(result: dict[str, Any]) -> list[str]:
    """When the prediction was made after the measurement (`bench sweep-sim`), and from what."""
    if not result.get("simulated"):
        return []
    models = sorted({str(s["sim"]["cost_model"]) for s in result["systems"]
                     if (s.get("sim") or {}).get("cost_model")})  # fmt: skip
    return [f"- simulated again on {result['simulated']} (`pdserve bench sweep-sim`), cost "
            f"model{'s' if len(models) > 1 else ''}: {', '.join(models) or 'none'}"]  # fmt: skip


# ---------------------------------------------------------------------------- the plot


def plot(result: dict[str, Any], path: Path) -> None:
    """Goodput and attainment against the rate: a solid line per measured system (min-max
    bars over repeats), dashed for the simulator's prediction in the same colour, dotted for
    its prediction at the host's probed level, dash-dotted at the points' own steps' level."""
    plt = plots.pyplot()
    fig, (ax_g, ax_a) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, s in enumerate(s for s in result["systems"] if s.get("points") or s.get("sim")):
        color = f"C{i}"
        pts = [p for p in s.get("points", []) if p.get("runs")]
        for ax, key in ((ax_g, "goodput"), (ax_a, "attainment")):
            if pts:
                med = [p["spread"][key]["median"] for p in pts]
                lo = [m - p["spread"][key]["min"] for m, p in zip(med, pts, strict=True)]
                hi = [p["spread"][key]["max"] - m for m, p in zip(med, pts, strict=True)]
                ax.errorbar([p["rate"] for p in pts], med, yerr=[lo, hi], color=color,
                            marker="o", capsize=3, label=s["name"])  # fmt: skip
            sim = (s.get("sim") or {}).get("points") or []
            if sim:
                ax.plot([p["rate"] for p in sim], [p[key] for p in sim], "--", color=color,
                        marker="x", label=f"{s['name']} (sim)")  # fmt: skip
            for level, style, what in (("levelled", ":", "probed"), ("stepped", "-.", "steps")):
                at = (s.get("sim") or {}).get(level) or []
                if at:
                    ax.plot([p["rate"] for p in at], [p[key] for p in at], style, color=color,
                            marker="+", label=f"{s['name']} (sim at {what} level)")  # fmt: skip
    ax_a.axhline(result["knee_attainment"], color="grey", lw=0.8, ls=":")
    ax_g.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title="goodput")
    ax_a.set(xlabel="request rate (req/s)", ylabel="share within both SLOs",
             title="SLO attainment", ylim=(-0.02, 1.02))  # fmt: skip
    ax_g.legend(fontsize=8)
    plots.save(fig, path)


def write(result: dict[str, Any], folder: Path) -> str:
    """summary.json, report.md and sweep.png under `folder`; returns the markdown."""
    result["summary"] = summarize(result, result["knee_attainment"])
    report.write_json(folder / "summary.json", result)
    text = render(result)
    (folder / "report.md").write_text(text)
    plot(result, folder / "sweep.png")
    return text
