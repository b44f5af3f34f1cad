"""The report of `pdserve bench sched`: one markdown table per experiment, arms side by side.

Each table has a row per number, the two arms' values and A/B (the feature over its baseline)
where both are numbers. Numbers come from each arm's `summary` (`sched.summarize_arm`); anything
missing (a server field not there yet, an arm that failed) reads "n/a". Works on the results dict
alone, so a saved results.json re-makes the report (`rebuild`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

NA = "n/a"

Getter = Callable[[dict[str, Any]], Any]


def _at(*path: str | int) -> Getter:
    """A getter of summary[path[0]][path[1]]..., None when any step is missing."""

    def get(summary: dict[str, Any]) -> Any:
        cur: Any = summary
        for key in path:
            if isinstance(cur, dict) and key in cur:
                cur = cur[key]
            else:
                return None
        return cur

    return get


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def fmt(v: Any, kind: str) -> str:
    """One cell: numbers by kind (int, rps, pct, ms, ms1, bytes, frac), dicts as k: v lists."""
    if v is None:
        return NA
    if kind == "dict":
        if not isinstance(v, dict) or not v:
            return NA if not isinstance(v, dict) else "none"
        return ", ".join(f"{k}: {_short(x)}" for k, x in v.items())
    if kind == "switches":
        if not isinstance(v, list):
            return NA
        if not v:
            return "none"
        return "; ".join(
            f"{s.get('worker')} {s.get('from')}->{s.get('to')} @{s.get('t_s')}s" for s in v
        )
    if kind == "text":
        return str(v)
    x = _number(v)
    if x is None:
        return NA
    if kind == "int":
        return f"{x:.0f}"
    if kind == "rps":
        return f"{x:.3f}"
    if kind == "pct":
        return f"{100 * x:.1f}%"
    if kind == "ms":
        return f"{x:.0f}"
    if kind == "ms1":
        return f"{x:.1f}"
    if kind == "frac":
        return f"{x:.3f}"
    if kind == "g4":
        return f"{x:.4g}"
    if kind == "bytes":
        return f"{x / 2**20:.2f} MiB"
    return f"{x:g}"


def _short(x: Any) -> str:
    n = _number(x)
    if n is None:
        return str(x)
    return f"{n:.0f}" if n == int(n) else f"{n:.3g}"


def ratio(a: Any, b: Any) -> str:
    x, y = _number(a), _number(b)
    if x is None or y is None:
        return NA
    if y == 0:
        return NA if x == 0 else "inf"
    return f"{x / y:.2f}x"


RATIO_KINDS = ("int", "rps", "pct", "ms", "ms1", "frac", "bytes")
Row = tuple[str, Getter, str]


def _count(path: str) -> Getter:
    def get(summary: dict[str, Any]) -> Any:
        v = summary.get(path)
        return len(v) if isinstance(v, list) else None

    return get


def _phase_rows(phase: str) -> list[Row]:
    return [
        (f"goodput, {phase} (req/s)", _at("by_phase", phase, "goodput"), "rps"),
        (f"SLO attainment, {phase}", _at("by_phase", phase, "slo_attainment"), "pct"),
    ]


COMMON: list[Row] = [
    ("sent", _at("sent"), "int"),
    ("admitted", _at("admitted"), "int"),
    ("rejected", _at("rejected"), "int"),
    ("failed", _at("failed"), "int"),
    ("goodput (req/s)", _at("goodput"), "rps"),
    ("SLO attainment, all sent", _at("slo_attainment"), "pct"),
    ("SLO attainment, admitted", _at("slo_attainment_admitted"), "pct"),
    ("TTFT p50 (ms)", _at("ttft_ms", "p50"), "ms"),
    ("TTFT p90 (ms)", _at("ttft_ms", "p90"), "ms"),
    ("TPOT p50 (ms)", _at("tpot_ms", "p50"), "ms1"),
    ("TPOT p90 (ms)", _at("tpot_ms", "p90"), "ms1"),
    ("prediction error TTFT p50", _at("prediction_error", "ttft", "p50"), "frac"),
    ("prediction error TTFT p90", _at("prediction_error", "ttft", "p90"), "frac"),
    ("prediction error TPOT p50", _at("prediction_error", "tpot", "p50"), "frac"),
    ("prediction error TPOT p90", _at("prediction_error", "tpot", "p90"), "frac"),
    ("requests with a prediction", _at("prediction_error", "with_prediction"), "int"),
]

ROWS: dict[str, list[Row]] = {
    "admission": [
        ("rejected by code (client)", _at("rejected_by_code"), "dict"),
        ("rejection latency p50 (ms)", _at("rejection_latency_ms", "p50"), "ms1"),
        ("rejection latency p99 (ms)", _at("rejection_latency_ms", "p99"), "ms1"),
        ("Retry-After p50 (s)", _at("retry_after_s", "p50"), "frac"),
        ("rejections by reason (server)", _at("server_rejections"), "dict"),
    ],
    "conditional": [
        *_phase_rows("short"),
        *_phase_rows("long"),
        ("route decisions (/metrics)", _at("routes"), "dict"),
        ("predicted routes (timelines)", _at("routes_from_timelines"), "dict"),
        ("KV bytes sent", _at("kv_bytes_sent"), "bytes"),
    ],
    "prefix": [
        ("prefix hit rate (workers, mean)", _at("prefix", "hit_rate_mean"), "pct"),
        ("prefix hit rate by worker", _at("prefix", "hit_rate_by_worker"), "dict"),
        ("prefix counters (router, over the load)", _at("prefix", "counters"), "dict"),
        (
            "prompt tokens cached (router's predictions)",
            _at("prefix", "cached_share_predicted"),
            "pct",
        ),
        ("TTFT p50, turns > 0 (ms)", _at("turns", "later_turns", "p50"), "ms"),
        ("TTFT p90, turns > 0 (ms)", _at("turns", "later_turns", "p90"), "ms"),
        ("KV bytes sent", _at("kv_bytes_sent"), "bytes"),
    ],
    "autobalance": [
        *_phase_rows("prefill-heavy"),
        *_phase_rows("decode-heavy"),
        ("role switches (count, polled)", _count("role_switches"), "int"),
        ("role switches (server counter)", _at("role_switches_server"), "dict"),
        ("role switches", _at("role_switches"), "switches"),
        ("roles at the end", _at("roles_final"), "dict"),
    ],
}


def _per_turn(arms: list[dict[str, Any]]) -> list[str]:
    turns = sorted(
        {t for a in arms for t in (_at("summary", "turns", "per_turn")(a) or {})}, key=int
    )
    if not turns:
        return []
    names = [a["arm"] for a in arms]
    lines = [
        "TTFT p50 per turn (ms):",
        "",
        "| turn | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for t in turns:
        cells = [fmt(_at("summary", "turns", "per_turn", t, "p50")(a), "ms") for a in arms]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def experiment_table(exp: dict[str, Any]) -> list[str]:
    arms = exp.get("arms") or []
    if len(arms) < 2:
        return []
    a, b = arms[0], arms[1]
    sa, sb = a.get("summary") or {}, b.get("summary") or {}
    lines = [
        f"| metric | A: {a['arm']} | B: {b['arm']} | A/B |",
        "|---|---|---|---|",
    ]
    for label, get, kind in [*ROWS.get(exp["name"], []), *COMMON]:
        va, vb = get(sa), get(sb)
        r = ratio(va, vb) if kind in RATIO_KINDS else "-"
        lines.append(f"| {label} | {fmt(va, kind)} | {fmt(vb, kind)} | {r} |")
    return lines


def _experiment(exp: dict[str, Any]) -> list[str]:
    topo = exp.get("topology") or {}
    lines = [
        f"## {exp['name']}",
        "",
        f"- workers: {topo.get('prefill', NA)}P + {topo.get('decode', NA)}D, "
        f"{topo.get('threads', NA)} thread(s) each",
        "- workload: "
        + ", ".join(f"{k}={_setting(v)}" for k, v in (exp.get("workload") or {}).items()),
    ]
    if exp.get("failed"):
        return [*lines, f"- **not measured**: {exp['failed']}", ""]
    slo = exp.get("slo") or {}
    cal = exp.get("calibration") or {}
    lines += [
        f"- SLOs: TTFT {fmt(slo.get('ttft_s'), 'g4')} s, TPOT {fmt(slo.get('tpot_s'), 'g4')} s"
        f" ({slo.get('how') or NA})",
        f"- load: {fmt(exp.get('rate'), 'frac')} req/s, {_arrivals(exp.get('burstiness'))} "
        f"({cal.get('rate_how') or NA}), {exp.get('num_requests', NA)} requests per arm",
    ]
    if cal.get("command"):
        lines.append(f"- calibration server: `{cal['command']}`")
    for arm in exp.get("arms") or []:
        lines.append(f"- arm {arm['arm']}: `{arm.get('command', NA)}`")
    lines.append("")
    lines += [*experiment_table(exp), ""]
    lines += _per_turn(exp.get("arms") or []) if exp["name"] == "prefix" else []
    for arm in exp.get("arms") or []:
        if arm.get("failed"):
            lines.append(f"- arm {arm['arm']} failed: {arm['failed']}")
        errors = (arm.get("bench") or {}).get("errors") or []
        for e in errors:
            lines.append(f"- arm {arm['arm']} error: {e}")
    return lines if lines[-1] == "" else [*lines, ""]


def _arrivals(burstiness: Any) -> str:
    b = _number(burstiness)
    if b is None:
        return "gamma arrivals"
    return "Poisson arrivals" if b == 1 else f"gamma arrivals (burstiness {b:g})"


def _setting(v: Any) -> str:
    if isinstance(v, list | tuple):
        return "-".join(str(x) for x in v)
    return str(v)


def build_report(result: dict[str, Any]) -> str:
    m = result.get("machine") or {}
    load = m.get("load_average")
    lines = [
        "# pdserve bench sched: scheduling features against their baselines",
        "",
        f"- command: `{result.get('command', NA)}`",
        f"- machine: {m.get('cpu', NA)}, {m.get('cores', NA)} cores, python "
        f"{m.get('python', NA)}"
        + (f", load average at start {', '.join(f'{x:.2f}' for x in load)}" if load else ""),
        f"- started: {result.get('started', NA)}, wall time {fmt(result.get('wall_s'), 'int')} s",
        "- A is the feature, B its baseline; A/B is their ratio; n/a: the server did not "
        "report it (or the arm failed). Goodput: requests meeting both SLOs per second of "
        "load; attainment of admitted requests excludes those the server rejected.",
        "",
    ]
    for exp in result.get("experiments") or []:
        lines += _experiment(exp)
    return "\n".join(lines).rstrip() + "\n"


def rebuild(results_json: Path) -> str:
    """The report of a saved results.json (written next to it as report.md)."""
    result = json.loads(results_json.read_text())
    text = build_report(result)
    (results_json.parent / "report.md").write_text(text)
    return text
