"""Writes docs/grafana/pdserve.json: the Grafana board over the router's pdserve_* metrics.

    python scripts/grafana_board.py            # rewrite the board after editing PANELS

The board mirrors the router's /dashboard page where Prometheus has the numbers: latency
quantiles against the SLOs, goodput, outcomes, rejections, routes, the pools' gauges, role
switches and outages, KV transfer, prediction error. Per-request waterfalls and worker
states/heartbeat ages are only on the page (they are not metrics). tests/test_grafana.py checks
that every metric the board queries is one the router exposes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "pdserve.json"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def q(le: str, metric: str, by: str = "") -> str:
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({le}, sum by ({group}) (rate({metric}_bucket[1m])))"


def ts(title: str, targets: list[tuple[str, str]], unit: str, w: int = 8, **extra: Any) -> dict:
    return {
        "type": "timeseries",
        "title": title,
        "datasource": DS,
        "gridPos": {"w": w, "h": 8},
        "fieldConfig": {"defaults": {"unit": unit, **extra.pop("defaults", {})}, "overrides": []},
        "targets": [
            {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(65 + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
        **extra,
    }


def slo_line(var: str) -> tuple[str, str]:
    return (f"vector(${var}) > 0", "SLO")  # filtered out (no line) while the variable is 0


def stat(title: str, expr: str, unit: str, w: int = 4) -> dict:
    panel = ts(title, [(expr, title)], unit, w=w)
    panel["type"] = "stat"
    panel["gridPos"]["h"] = 4
    return panel


PANELS: list[dict] = [
    {"type": "row", "title": "Last minute", "gridPos": {"w": 24, "h": 1}, "collapsed": False},
    stat("TTFT p90", q("0.9", "pdserve_request_ttft_seconds"), "s"),
    stat("TPOT p90", q("0.9", "pdserve_request_tpot_seconds"), "s"),
    stat("goodput req/s", "sum(rate(pdserve_requests_within_slo_total[1m]))", "reqps"),
    stat("ok req/s", 'sum(rate(pdserve_requests_total{outcome="ok"}[1m]))', "reqps"),
    stat("rejected req/s", "sum(rate(pdserve_request_rejections_total[1m]))", "reqps"),
    stat("tokens/s", "sum(rate(pdserve_generation_tokens_total[1m]))", "short"),
    {"type": "row", "title": "Latency against the SLOs", "gridPos": {"w": 24, "h": 1}},
    ts(
        "TTFT (p50 / p90 of the last minute)",
        [
            (q("0.5", "pdserve_request_ttft_seconds"), "p50"),
            (q("0.9", "pdserve_request_ttft_seconds"), "p90"),
            slo_line("slo_ttft"),
        ],
        "s",
    ),
    ts(
        "TPOT (p50 / p90 of the last minute)",
        [
            (q("0.5", "pdserve_request_tpot_seconds"), "p50"),
            (q("0.9", "pdserve_request_tpot_seconds"), "p90"),
            slo_line("slo_tpot"),
        ],
        "s",
    ),
    ts(
        "Goodput (req/s within both SLOs)",
        [
            ("sum(rate(pdserve_requests_within_slo_total[1m]))", "goodput"),
            ('sum(rate(pdserve_requests_total{outcome="ok"}[1m]))', "finished ok"),
        ],
        "reqps",
    ),
    ts(
        "Inter-token latency (p50 / p90)",
        [
            (q("0.5", "pdserve_request_itl_seconds"), "p50"),
            (q("0.9", "pdserve_request_itl_seconds"), "p90"),
        ],
        "s",
    ),
    ts(
        "SLO misses by kind",
        [("sum by (kind) (rate(pdserve_slo_violations_total[1m]))", "{{kind}}")],
        "reqps",
    ),
    ts(
        "Prediction error |pred - actual| / actual (p50)",
        [(q("0.5", "pdserve_prediction_error_ratio", "kind"), "{{kind}}")],
        "percentunit",
    ),
    {"type": "row", "title": "Requests", "gridPos": {"w": 24, "h": 1}},
    ts(
        "Requests by outcome",
        [("sum by (outcome) (rate(pdserve_requests_total[1m]))", "{{outcome}}")],
        "reqps",
    ),
    ts(
        "Rejections by reason",
        [("sum by (code) (rate(pdserve_request_rejections_total[1m]))", "{{code}}")],
        "reqps",
    ),
    ts(
        "Route decisions",
        [("sum by (route) (rate(pdserve_route_decisions_total[1m]))", "{{route}}")],
        "reqps",
    ),
    {"type": "row", "title": "Pools", "gridPos": {"w": 24, "h": 1}},
    ts("Queue per worker", [("pdserve_worker_queue_length", "{{worker}} ({{role}})")], "short"),
    ts(
        "Batch per worker (requests in the last step)",
        [("pdserve_worker_batch_requests", "{{worker}} ({{role}})")],
        "short",
    ),
    ts(
        "KV use per worker",
        [
            (
                "pdserve_worker_kv_blocks_used / pdserve_worker_kv_blocks_total",
                "{{worker}} ({{role}})",
            )
        ],
        "percentunit",
    ),
    ts("Running per worker", [("pdserve_worker_running", "{{worker}} ({{role}})")], "short"),
    ts(
        "Prefill / decode tokens/s per worker",
        [
            ("rate(pdserve_worker_prefill_tokens_total[1m])", "prefill {{worker}}"),
            ("rate(pdserve_worker_decode_tokens_total[1m])", "decode {{worker}}"),
        ],
        "short",
    ),
    ts(
        "Role switches, outages, recoveries",
        [
            ("sum by (by) (increase(pdserve_role_switches_total[1m]))", "switch by {{by}}"),
            ("sum by (reason) (increase(pdserve_worker_down_total[1m]))", "down: {{reason}}"),
            ("sum by (how) (increase(pdserve_recoveries_total[1m]))", "recovered: {{how}}"),
        ],
        "short",
    ),
    {"type": "row", "title": "KV transfer", "gridPos": {"w": 24, "h": 1}},
    ts(
        "KV bytes/s by side",
        [("sum by (side) (rate(pdserve_kv_transfer_bytes_total[1m]))", "{{side}}")],
        "Bps",
    ),
    ts(
        "KV hand-off time p90 by side",
        [(q("0.9", "pdserve_kv_transfer_seconds", "side"), "{{side}}")],
        "s",
    ),
    ts(
        "Retries, recomputes, transfer failures",
        [
            ("sum(increase(pdserve_retries_total[1m]))", "retries"),
            ("sum(increase(pdserve_recomputes_total[1m]))", "recomputes"),
            ("sum(increase(pdserve_kv_transfer_failures_total[1m]))", "failures"),
        ],
        "short",
    ),
]


def layout(panels: list[dict]) -> list[dict]:
    """Ids and grid positions: left to right, wrapping at 24 columns; rows span the width."""
    x = y = row_h = 0
    for i, p in enumerate(panels, start=1):
        p["id"] = i
        g = p["gridPos"]
        if p["type"] == "row" or x + g["w"] > 24:
            x, y, row_h = 0, y + row_h, 0
        g["x"], g["y"] = x, y
        if p["type"] == "row":
            p.setdefault("collapsed", False)
            p.setdefault("panels", [])
            y += g["h"]
            continue
        x += g["w"]
        row_h = max(row_h, g["h"])
    return panels


def variable(name: str, label: str) -> dict:
    return {
        "type": "textbox",
        "name": name,
        "label": label,
        "query": "0",
        "current": {"text": "0", "value": "0"},
        "description": "seconds, the router's --" + name.replace("_", "-") + "; 0 hides the line",
    }


def annotation(name: str, expr: str, color: str) -> dict:
    return {
        "name": name,
        "datasource": DS,
        "enable": True,
        "iconColor": color,
        "expr": expr,
        "step": "15s",
        "titleFormat": name,
        "textFormat": "{{by}}{{reason}}",
    }


def board() -> dict:
    return {
        "__inputs": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "description": "the Prometheus that scrapes the pdserve router",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
        ],
        "uid": "pdserve",
        "title": "pdserve",
        "description": "pdserve router: latency against SLOs, goodput, pools, KV transfer.",
        "tags": ["pdserve", "llm-serving"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "timezone": "browser",
        "templating": {
            "list": [variable("slo_ttft", "TTFT SLO (s)"), variable("slo_tpot", "TPOT SLO (s)")]
        },
        "annotations": {
            "list": [
                annotation(
                    "role switch",
                    "sum by (by) (increase(pdserve_role_switches_total[1m])) > 0",
                    "purple",
                ),
                annotation(
                    "worker down",
                    "sum by (reason) (increase(pdserve_worker_down_total[1m])) > 0",
                    "red",
                ),
            ]
        },
        "panels": layout(PANELS),
    }


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(board(), indent=2) + "\n")
    print(f"wrote {OUT}")
