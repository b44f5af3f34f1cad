"""`pdserve top`: the dashboard's numbers in a terminal, for a server without a browser.

    pdserve top --url http://127.0.0.1:8000 --api-key KEY     # refreshes every second
    pdserve top --once                                         # one print, then exit

Reads the same JSON as the page (`GET /admin/dashboard.json`, router/dashboard.py) and draws it
with `rich`: the last minute's TTFT/TPOT p50/p90 against the SLOs and goodput, the pools (with
the workers Ray cannot place yet and why: "pending: needs CPU 1.0, 0 free"), the counters
(outcomes, rejections by reason, routes), the latest worker events and the last requests with
their stage times across P and D.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import httpx
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

JSON_PATH = "/admin/dashboard.json"
STATE_STYLE = {"ready": "green", "draining": "yellow", "degraded": "yellow", "down": "red"}
STAGES = ("queue", "prefill", "transfer", "decode")
PIPE_WIDTH = 160


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the router's base URL")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="the router's --api-key (default: $PDSERVE_API_KEY)",
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--requests", type=int, default=10, help="last requests to show")


def fetch(client: httpx.Client, url: str, api_key: str | None) -> dict[str, Any]:
    """The dashboard snapshot; ValueError with the server's message on an HTTP error."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = client.get(url.rstrip("/") + JSON_PATH, headers=headers)
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise ValueError(f"{r.status_code} from {url}{JSON_PATH}: {message}")
    body: dict[str, Any] = r.json()
    return body


# ---- rendering ---------------------------------------------------------------------------------
def _ms(s: float | None) -> str:
    if s is None:
        return "–"
    return f"{s * 1000:.1f} ms" if s < 0.1 else f"{s * 1000:.0f} ms" if s < 10 else f"{s:.1f} s"


def _n(v: Any) -> str:
    return "–" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def _vs_slo(value: float | None, slo: float | None) -> Text:
    miss = value is not None and slo is not None and value > slo
    return Text(_ms(value), style="bold red" if miss else "")


def headline(snap: dict[str, Any]) -> Table:
    now, slo = snap["now"], snap["slo"]
    t = Table(title=f"last {snap['window_s']:g} s", title_justify="left", box=None, pad_edge=False)
    for col in ("TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "goodput/s", "ok/s", "finished"):
        t.add_column(col, justify="right")
    t.add_row(
        _vs_slo(now["ttft_p50"], slo["ttft_s"]),
        _vs_slo(now["ttft_p90"], slo["ttft_s"]),
        _vs_slo(now["tpot_p50"], slo["tpot_s"]),
        _vs_slo(now["tpot_p90"], slo["tpot_s"]),
        f"{now['goodput_rps']:.2f}",
        f"{now['throughput_rps']:.2f}",
        str(now["n"]),
    )
    t.caption = f"SLO: TTFT {_ms(slo['ttft_s'])} · TPOT {_ms(slo['tpot_s'])}"
    t.caption_justify = "left"
    return t


def pools(snap: dict[str, Any]) -> Table:
    t = Table(title="pools", title_justify="left")
    cols = ("worker", "role", "state", "batch", "queue", "running", "in flight", "KV use")
    for col in (*cols, "prefix hit", "heartbeat", "pid"):
        t.add_column(col, justify="left" if col in ("worker", "role", "state") else "right")
    for w in snap["workers"]:
        state = w["state"] + (f" ({w['down_reason']})" if w["down_reason"] else "")
        kv = f"{w['kv_blocks_used']}/{w['kv_blocks_total']}"
        if w["kv_use"] is not None:
            kv += f" {w['kv_use']:.0%}"
        hit = "–" if w["prefix_hit_rate"] is None else f"{w['prefix_hit_rate']:.0%}"
        t.add_row(
            w["id"],
            w["role"],
            Text(state, style=STATE_STYLE.get(w["state"], "")),
            _n(w["batch"]),
            _n(w["queue"]),
            _n(w["running"]),
            _n(w["outstanding"]),
            kv,
            hit,
            _ms(w["heartbeat_age_s"]),
            _n(w["pid"]),
        )
    for p in snap.get("pending", []):  # not placed yet: the reason in the state column
        t.add_row(p["worker"], p["role"], Text(p["reason"], style="yellow"))
    return t


def counters(snap: dict[str, Any]) -> Table:
    totals = snap["totals"]
    t = Table(title="totals", title_justify="left")
    t.add_column("what")
    t.add_column("counts")

    def line(d: dict[str, float]) -> str:
        items = sorted(d.items(), key=lambda kv: -kv[1])
        return "  ".join(f"{k} {v:g}" for k, v in items) or "none"

    t.add_row("requests", line(totals["requests"]))
    t.add_row("rejections", line(totals["rejections"]))
    t.add_row("routes", line(totals["routes"]))
    t.add_row("KV bytes", line(totals["kv_transfer_bytes"]))
    t.add_row(
        "tokens", f"prompt {totals['prompt_tokens']:g}  generated {totals['generation_tokens']:g}"
    )
    if snap.get("kv_pool"):
        pool = "  ".join(
            f"{p['tier']}: hit {_n(p['hit_rate'])} bytes {_n(p['bytes'])}" for p in snap["kv_pool"]
        )
        t.add_row("KV pool", pool)
    return t


def events(snap: dict[str, Any], n: int = 5) -> Table:
    t = Table(title="worker events", title_justify="left")
    for col in ("time", "worker", "event", "detail"):
        t.add_column(col)
    for e in snap["events"][-n:][::-1]:
        clock = time.strftime("%H:%M:%S", time.localtime(e["t"]))
        t.add_row(clock, e["worker"], e["kind"], e["detail"])
    if not snap["events"]:
        t.add_row("–", "", "none seen", "")
    return t


def requests(snap: dict[str, Any], n: int) -> Table:
    t = Table(title="last requests (ms per stage; predicted in brackets)", title_justify="left")
    for col in ("id", "route", "outcome", *STAGES, "TTFT", "TPOT"):
        t.add_column(col, justify="right" if col in STAGES else "left")
    slo = snap["slo"]
    for r in snap["requests"][:n]:
        spans = {s["stage"]: s["end_ms"] - s["start_ms"] for s in r["segments"]}
        ttft = _vs_slo(r["ttft_s"], slo["ttft_s"])
        tpot = _vs_slo(r["tpot_s"], slo["tpot_s"])
        if r["predicted_ttft_s"] is not None:
            ttft.append(f" ({_ms(r['predicted_ttft_s'])})", style="dim")
        if r["predicted_tpot_s"] is not None:
            tpot.append(f" ({_ms(r['predicted_tpot_s'])})", style="dim")
        stage_ms = [f"{spans[s]:.1f}" if s in spans else "–" for s in STAGES]
        t.add_row(r["id"][:24], r["route"] or "–", r["outcome"], *stage_ms, ttft, tpot)
    return t


def render(snap: dict[str, Any], n_requests: int = 10) -> Group:
    stamp = time.strftime("%H:%M:%S", time.localtime(snap["t"]))
    return Group(
        Text(f"pdserve top · {stamp}", style="bold"),
        headline(snap),
        pools(snap),
        counters(snap),
        events(snap),
        requests(snap, n_requests),
    )


# ---- the command -------------------------------------------------------------------------------
def run(args: argparse.Namespace, client: httpx.Client | None = None) -> int:
    if args.interval <= 0:
        raise ValueError("--interval must be > 0")
    own = client is None
    client = client or httpx.Client(timeout=5.0)
    console = Console()
    if not console.is_terminal:  # a pipe or a file: wide enough for every column
        console = Console(width=PIPE_WIDTH)
    try:
        if args.once:
            console.print(render(fetch(client, args.url, args.api_key), args.requests))
            return 0
        return _live(client, args, console)
    except httpx.HTTPError as e:
        print(f"pdserve top: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    finally:
        if own:
            client.close()


def _live(client: httpx.Client, args: argparse.Namespace, console: Console) -> int:
    from rich.live import Live

    with Live(console=console, screen=True, auto_refresh=False) as live:
        try:
            while True:
                live.update(render(fetch(client, args.url, args.api_key), args.requests))
                live.refresh()
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
