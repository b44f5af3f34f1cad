"""The report of `pdserve bench compare`: a markdown table and three matplotlib plots.

  * report.md       the command, the machine, the SLOs and how they were chosen, a summary (best
                    goodput per system and the ratios the benchmark issue asks about), one row per
                    system and rate, and pdserve's mean per-request time breakdown;
  * attainment.png  SLO attainment and goodput against the request rate, one line per system;
  * latency.png     TTFT and TPOT distributions (box plots) per rate and system;
  * breakdown.png   per-request stacked bars (queue / prefill / transfer / decode) from pdserve's
                    timelines at the highest rate.

`breakdown` turns one pdserve timeline into those four spans; everything here works on the
results dict alone, so a report can be re-made from a saved results.json (`rebuild`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.harness import plots
from pdserve.bench.peers import PEER_NAMES as PEERS
from pdserve.router.timeline import Ev, Stage

STAGES = ("queue", "prefill", "transfer", "decode")
COLORS = {"queue": "#bbbbbb", "prefill": "#4c72b0", "transfer": "#dd8452", "decode": "#55a868"}


def breakdown(events: list[dict[str, Any]]) -> dict[str, float] | None:
    """Spans (ms) of a finished request from its pdserve timeline, or None when incomplete.

    queue:    arrival -> prefill start (routing, P's queue);
    prefill:  prefill start -> the first token;
    transfer: the first token -> the KV fully on D (0 when colocated; only the part not
              hidden behind the prefill, since layer-wise streaming overlaps the rest);
    decode:   the later of those two -> the last token.
    A retried request is measured on its last attempt (the events after the last dispatch)."""
    last_dispatch = max((i for i, e in enumerate(events) if e["event"] == Ev.DISPATCH), default=0)
    at: dict[str, float] = {}
    for e in events[last_dispatch:]:
        at.setdefault(e["event"], e["t_ms"])
    finish = next((e["t_ms"] for e in events if e["event"] == Ev.FINISH), None)
    if finish is None or Stage.PREFILL_START not in at or Stage.PREFILL_END not in at:
        return None
    start, end = at[Stage.PREFILL_START], at[Stage.PREFILL_END]
    kv_on_d = max(end, at.get(Stage.TRANSFER_END, end))
    return {
        "queue": start,
        "prefill": end - start,
        "transfer": kv_on_d - end,
        "decode": finish - kv_on_d,
    }


def _phases(system: dict[str, Any]) -> list[dict[str, Any]]:
    return list(system.get("rates", []))


def _fmt(v: float | None, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}"


def best_goodput(system: dict[str, Any]) -> tuple[float, float | None]:
    """(highest goodput over the sweep, the rate it was reached at)."""
    best, at = 0.0, None
    for res in _phases(system):
        if res["goodput"] > best:
            best, at = res["goodput"], res["config"]["rate"]
    return best, at


def ratio(a: float, b: float) -> str:
    if b <= 0:
        return "n/a (denominator 0)" if a <= 0 else "inf (denominator 0)"
    return f"{a / b:.2f}x"


def _summary(result: dict[str, Any]) -> list[str]:
    systems = {s["name"]: s for s in result["systems"] if "rates" in s}
    lines = [
        "| system | best goodput (req/s) | at rate | unloaded TTFT p50 (ms) | "
        "unloaded TPOT p50 (ms) |",
        "|---|---|---|---|---|",
    ]
    for name, s in systems.items():
        best, at = best_goodput(s)
        un = s.get("unloaded", {})
        lines.append(
            f"| {name} | {best:.3f} | {_fmt(at, 2)} | {_fmt(un.get('ttft_ms', {}).get('p50'))} "
            f"| {_fmt(un.get('tpot_ms', {}).get('p50'), 1)} |"
        )
    lines.append("")
    if "pdserve-1p1d" in systems:
        disagg = best_goodput(systems["pdserve-1p1d"])[0]
        if "pdserve-colocated" in systems:
            colo = best_goodput(systems["pdserve-colocated"])[0]
            lines.append(f"- best goodput, 1P1D / colocated: **{ratio(disagg, colo)}** (target 2x)")
        peers = [best_goodput(systems[p])[0] for p in PEERS if p in systems]
        if peers:
            lines.append(
                f"- best goodput, 1P1D / best peer: **{ratio(disagg, max(peers))}** (target 3x)"
            )
    return lines


def _per_rate(result: dict[str, Any]) -> list[str]:
    lines = [
        "| system | rate (req/s) | completed | failed | goodput (req/s) | attainment | "
        "TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | output tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result["systems"]:
        for res in _phases(s):
            t, p = res["ttft_ms"], res["tpot_ms"]
            lines.append(
                f"| {s['name']} | {res['config']['rate']:g} | {res['completed']} | "
                f"{res['failed']} | {res['goodput']:.3f} | {100 * res['good_fraction']:.0f}% | "
                f"{_fmt(t['p50'])} | {_fmt(t['p99'])} | {_fmt(p['p50'], 1)} | "
                f"{_fmt(p['p99'], 1)} | {res['output_throughput']:.1f} |"
            )
    return lines


def mean_breakdown(res: dict[str, Any]) -> dict[str, float] | None:
    spans = [b for r in res["requests"] if (b := breakdown(r.get("timeline") or []))]
    if not spans:
        return None
    return {k: float(np.mean([b[k] for b in spans])) for k in STAGES}


def _breakdown_table(result: dict[str, Any]) -> list[str]:
    lines = [
        "| system | rate | queue | prefill | transfer (exposed) | decode |",
        "|---|---|---|---|---|---|",
    ]
    for s in result["systems"]:
        for res in _phases(s):
            b = mean_breakdown(res)
            if b is not None:
                cells = " | ".join(_fmt(b[k]) for k in STAGES)
                lines.append(f"| {s['name']} | {res['config']['rate']:g} | {cells} |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    wl, slo, mach = result["workload"], result["slo"], result["machine"]
    out = [
        f"# bench compare: {wl['workload']} workload",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {mach['cpu']}, {mach['cores']} cores (all systems given {result['cores']}), "
        f"Python {mach['python']}. Started {result['started']}, {result['wall_s'] / 60:.1f} min.",
        "",
        f"Workload: `{wl['workload']}`, prompts ~{wl['input_len']} tokens, {wl['output_len']} "
        f"output tokens (spread {wl['len_spread']}), {wl['num_requests']} requests per rate, "
        f"seed {wl['seed']}; rates {', '.join(f'{r:g}' for r in result['rates'])} req/s.",
        "",
        f"SLOs: TTFT <= {slo['ttft_s']:.2f} s, TPOT <= {slo['tpot_s'] * 1e3:.1f} ms "
        f"({slo['how']}).",
        "",
        "## Summary",
        "",
        *_summary(result),
    ]
    skipped = [s for s in result["systems"] if "rates" not in s]
    for s in skipped:
        out.append(f"- {s['name']}: not measured: {s.get('skipped') or s.get('failed')}")
    out += ["", "## Per rate (latencies in ms)", "", *_per_rate(result)]
    out += [
        "",
        "## pdserve: where the time went (mean per request, ms)",
        "",
        *_breakdown_table(result),
        "",
        "![SLO attainment and goodput](attainment.png)",
        "",
        "![TTFT and TPOT distributions](latency.png)",
        "",
        "![per-request breakdown](breakdown.png)",
        "",
    ]
    return "\n".join(out)


# ---------------------------------------------------------------------------- plots


def plot_attainment(result: dict[str, Any], path: Path) -> None:
    plt = plots.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for s in result["systems"]:
        phases = _phases(s)
        if not phases:
            continue
        rates = [r["config"]["rate"] for r in phases]
        ax1.plot(rates, [100 * r["good_fraction"] for r in phases], "o-", label=s["name"])
        ax2.plot(rates, [r["goodput"] for r in phases], "o-", label=s["name"])
    ax1.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(-5, 105))
    ax2.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)")
    ax1.set_title("requests meeting both SLOs")
    ax2.set_title("goodput")
    ax1.legend()
    plots.save(fig, path)


def plot_latency(result: dict[str, Any], path: Path) -> None:
    plt = plots.pyplot()
    systems = [s for s in result["systems"] if _phases(s)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(systems))
    for ax, key, slo in (
        (axes[0], "ttft_ms", result["slo"]["ttft_s"] * 1e3),
        (axes[1], "tpot_ms", result["slo"]["tpot_s"] * 1e3),
    ):
        for j, s in enumerate(systems):
            data = [[r[key] for r in res["requests"] if r.get(key) is not None] or [math.nan]
                    for res in _phases(s)]  # fmt: skip
            pos = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(data))]
            box = ax.boxplot(
                data, positions=pos, widths=width * 0.9, patch_artist=True, showfliers=True
            )
            color = f"C{j}"
            for patch in box["boxes"]:
                patch.set_facecolor(color)
            ax.plot([], [], color=color, lw=6, label=s["name"])
        ax.axhline(slo, color="red", ls="--", lw=1, label="SLO")
        ax.set_xticks(range(len(result["rates"])), [f"{r:g}" for r in result["rates"]])
        ax.set(xlabel="request rate (req/s)", ylabel=key.replace("_ms", " (ms)").upper())
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    plots.save(fig, path)


def plot_breakdown(result: dict[str, Any], path: Path) -> None:
    plt = plots.pyplot()
    panels = []
    for s in result["systems"]:
        phases = _phases(s)
        if phases and any(r.get("timeline") for r in phases[-1]["requests"]):
            panels.append((s["name"], phases[-1]))
    fig, axes = plt.subplots(
        len(panels) or 1, 1, figsize=(11, 3.2 * max(1, len(panels))), squeeze=False
    )
    for ax, (name, res) in zip(axes[:, 0], panels, strict=False):
        spans = [breakdown(r.get("timeline") or []) for r in res["requests"]]
        spans_ok = [b for b in spans if b is not None]
        x = np.arange(len(spans_ok))
        bottom = np.zeros(len(spans_ok))
        for stage in STAGES:
            vals = np.array([b[stage] for b in spans_ok]) / 1e3
            ax.bar(x, vals, bottom=bottom, color=COLORS[stage], label=stage)
            bottom += vals
        ax.set(
            ylabel="seconds",
            title=f"{name}, rate {res['config']['rate']:g} req/s (requests in order of arrival)",
        )
        ax.legend(ncol=4, fontsize=8)
    plots.save(fig, path)


def write_report(result: dict[str, Any], out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_attainment(result, out_dir / "attainment.png")
    plot_latency(result, out_dir / "latency.png")
    plot_breakdown(result, out_dir / "breakdown.png")
    text = markdown(result)
    (out_dir / "report.md").write_text(text)
    return text


def rebuild(results_json: Path) -> str:
    """Re-make report.md and the plots next to a saved results.json."""
    return write_report(json.loads(results_json.read_text()), results_json.parent)
