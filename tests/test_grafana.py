"""docs/grafana/pdserve.json: import-ready, in sync with scripts/grafana_board.py, and every
metric (and label) it queries is one the router's /metrics exposes."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdserve.metrics import Metrics
from pdserve.workers import messages as m

ROOT = Path(__file__).resolve().parent.parent
BOARD = ROOT / "docs" / "grafana" / "pdserve.json"
METRIC = re.compile(r"\bpdserve_[a-zA-Z0-9_]+\b")
BY = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")


def exposed() -> dict[str, set[str]]:
    """Sample name -> label names, from /metrics' text after every hook has fired once."""
    mx = Metrics(slo_ttft_s=1.0, slo_tpot_s=0.1)
    stats = {
        **{k: 1 for k in ("waiting", "running", "batch_requests", "batch_tokens")},
        **{k: 1 for k in ("kv_blocks_used", "kv_blocks_total", "prefix_cache_hit_rate")},
        **{k: 1 for k in ("preemptions", "prefill_tokens", "decode_tokens", "lease_reclaims")},
        **{k: 1 for k in ("transfer_failures", "handoffs_acked", "handoffs_received")},
        "threads": 2,
    }
    mx.on_worker_stats(SimpleNamespace(worker_id="P0", role="prefill"), stats)
    flight = SimpleNamespace(
        rid="r", prompt_ids=[1, 2], sent=[3, 4], route="remote",
        timeline=[("arrive", "router", 0.0), ("first_token", "P0", 0.001)],
    )  # fmt: skip
    mx.on_request_end(flight, "ok")
    mx.on_transfer(m.TransferReport("r.1", "P0", "send", 1, 10, 0.001, "none"))
    mx.on_rejected("empty_prompt")
    mx.on_route("remote")
    mx.on_prediction("ttft", 0.1)
    mx.on_role_switch("admin")
    mx.on_thread_move("decode")
    mx.on_retry(None)
    mx.on_recompute()
    mx.on_worker_down(None, "stuck")
    mx.on_recovery("pair")
    mx.on_conversation("miss")
    mx.on_delta("r2", 1, 0.0)
    mx.on_delta("r2", 1, 0.01)
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(mx.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def board() -> dict[str, Any]:
    return json.loads(BOARD.read_text())


def exprs(b: dict[str, Any]) -> list[str]:
    found = [t["expr"] for p in b["panels"] for t in p.get("targets", [])]
    return found + [a["expr"] for a in b["annotations"]["list"]]


def test_board_is_in_sync_with_its_generator() -> None:
    generated = runpy.run_path(str(ROOT / "scripts" / "grafana_board.py"))["board"]()
    assert generated == board(), "run: python scripts/grafana_board.py"


def test_board_is_import_ready() -> None:
    b = board()
    assert [i["name"] for i in b["__inputs"]] == ["DS_PROMETHEUS"]
    assert b["uid"] and b["title"] and b["schemaVersion"] >= 30
    ids = [p["id"] for p in b["panels"]]
    assert len(ids) == len(set(ids))
    for p in b["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"], p["title"]
    names = {v["name"] for v in b["templating"]["list"]}
    for e in exprs(b):
        assert e.count("(") == e.count(")") and e.count("[") == e.count("]"), e
        assert set(re.findall(r"\$([a-z_]+)", e)) <= names, e


def problems(expr: str, have: dict[str, set[str]]) -> list[str]:
    """What in `expr` /metrics does not have: metric names, then label names."""
    metrics = set(METRIC.findall(expr))
    if not metrics:  # only the SLO lines, drawn from a variable
        return [] if re.fullmatch(r"vector\(\$[a-z_]+\) > 0", expr) else ["no pdserve_* metric"]
    missing = sorted(metrics - have.keys())
    if missing:
        return missing
    labels = {x.strip() for group in BY.findall(expr) for x in group.split(",") if x.strip()}
    labels |= set(MATCHER.findall(expr))
    known = set().union(*(have[name] for name in metrics))
    return sorted(labels - known)


def test_every_queried_metric_and_label_is_exposed() -> None:
    have = exposed()
    queried: set[str] = set()
    for e in exprs(board()):
        assert not problems(e, have), (e, problems(e, have))
        queried |= set(METRIC.findall(e))
    # the headline numbers of the page are all on the board
    for name in (
        "pdserve_request_ttft_seconds_bucket",
        "pdserve_request_tpot_seconds_bucket",
        "pdserve_requests_within_slo_total",
        "pdserve_request_rejections_total",
        "pdserve_route_decisions_total",
        "pdserve_worker_queue_length",
        "pdserve_worker_kv_blocks_used",
        "pdserve_role_switches_total",
    ):
        assert name in queried, name


def test_the_check_catches_a_wrong_name_or_label() -> None:
    have = exposed()
    assert problems("rate(pdserve_request_ttft_second_bucket[1m])", have) == [
        "pdserve_request_ttft_second_bucket"
    ]
    assert problems("sum by (worker) (rate(pdserve_requests_total[1m]))", have) == ["worker"]
    assert problems('pdserve_requests_total{code="x"}', have) == ["code"]
    assert problems("vector(1)", have) == ["no pdserve_* metric"]


def test_thread_moves_and_each_workers_threads_are_exposed() -> None:
    have = exposed()
    assert have["pdserve_thread_moves_total"] == {"to"}
    assert have["pdserve_worker_threads"] == {"worker", "role"}
