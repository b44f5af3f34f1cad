"""What the dashboard costs: router CPU and GET /admin/dashboard.json latency with N open pages.

    python scripts/dashboard_bench.py [--pages 10] [--phase-s 30] [--rounds 2] [--model PATH]

Starts `pdserve serve` (default model, 1 P + 1 D, one thread each), keeps it under a steady
load (2 clients sending short completions), and alternates phases without and with `--pages`
pollers, each fetching the JSON once per second like an open page. For each phase: the router
process's own CPU (utime + stime from /proc, workers excluded), completions finished, and, with
pages, the JSON endpoint's latency. Then the cost of building one snapshot in-process over a full
ring of finished requests (no HTTP). Prints a Markdown report.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.hostinfo import cpu_model

KEY = "sk-bench"
AUTH = {"Authorization": f"Bearer {KEY}"}


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_serve(model: str | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", *([model] if model else [])]
    cmd += ["--port", str(port), "--threads", "1", "--api-key", KEY]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        ready = select.select([proc.stdout], [], [], 1.0)[0]
        if ready and "serving" in proc.stdout.readline():
            return proc, f"http://127.0.0.1:{port}"
    proc.kill()
    raise RuntimeError("pdserve serve did not start")


class Clients:
    """Threads that each loop `fn(client)` until stopped; `fn` returns a latency or None."""

    def __init__(self, url: str, n: int, fn: Any) -> None:
        self.stop_flag = threading.Event()
        self.values: list[float] = []
        self.count = 0
        self.threads = [
            threading.Thread(target=self._run, args=(url, fn), daemon=True) for _ in range(n)
        ]
        for t in self.threads:
            t.start()

    def _run(self, url: str, fn: Any) -> None:
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
            while not self.stop_flag.is_set():
                v = fn(c, self.stop_flag)
                self.count += 1
                if v is not None:
                    self.values.append(v)

    def stop(self) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(70)


def completion(model: str) -> Any:
    def fn(c: httpx.Client, _stop: threading.Event) -> None:
        body = {"model": model, "prompt": "Tell me about the sea. " * 8, "max_tokens": 16}
        c.post("/v1/completions", json={**body, "temperature": 0, "ignore_eos": True})

    return fn


def page_poll(c: httpx.Client, stop: threading.Event) -> float:
    t0 = time.perf_counter()
    r = c.get("/admin/dashboard.json")
    dt = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    stop.wait(max(0.0, 1.0 - dt))  # one fetch a second, like the page
    return dt


def phase(url: str, pid: int, pages: int, seconds: float, load: Clients) -> dict[str, Any]:
    before_cpu, before_done, t0 = proc_cpu_s(pid), load.count, time.monotonic()
    pollers = Clients(url, pages, page_poll) if pages else None
    time.sleep(seconds)
    if pollers is not None:
        pollers.stop()
    wall = time.monotonic() - t0
    cpu = proc_cpu_s(pid) - before_cpu
    lat = sorted(pollers.values) if pollers else []
    return {
        "pages": pages,
        "cpu_pct": 100 * cpu / wall,
        "done_per_s": (load.count - before_done) / wall,
        "polls": len(lat),
        "p50_ms": 1000 * statistics.median(lat) if lat else None,
        "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else None,
    }


def snapshot_cost(n_workers: int = 8, n_recent: int = 4096, reps: int = 50) -> dict[str, float]:
    """Median ms to build one snapshot (JSON bytes) in-process, ring full, 30-row waterfall."""
    from pdserve.metrics.prometheus import Finished, Metrics
    from pdserve.router.dashboard import Dashboard

    class Core:
        counters: dict[str, int] = {}  # noqa: RUF012

        def worker_table(self) -> list[dict[str, Any]]:
            return [
                {"id": f"W{i}", "role": "decode", "healthy": True, "pid": i, "queue": 1}
                for i in range(n_workers)
            ]

        def worker_vitals(self) -> dict[str, Any]:
            return {f"W{i}": {"heartbeat_age_s": 0.2, "stats": {}} for i in range(n_workers)}

        def timeline(self, rid: str) -> list[dict[str, Any]]:
            names = ["arrive", "dispatch", "queue", "prefill_start", "transfer_start"]
            names += ["prefill_end", "first_token", "transfer_end", "decode_first_token", "finish"]
            return [{"event": e, "worker": "W0", "t_ms": float(i)} for i, e in enumerate(names)]

    metrics = Metrics(slo_ttft_s=1.0, slo_tpot_s=0.1)
    now = time.monotonic()
    for i in range(n_recent):
        metrics.recent.append(Finished(f"r{i}", now - 60 + i * 60 / n_recent, "ok", "remote",
                                       100, 16, 0.05, 0.02, True))  # fmt: skip
    board = Dashboard(Core(), metrics)
    times = []
    for k in range(reps):
        t0 = time.perf_counter()
        board.snapshot_bytes(now=now + k)  # a new second each time: never the cache
        times.append(time.perf_counter() - t0)
    size = len(board.snapshot_bytes(now=now + reps))
    return {"build_ms": 1000 * statistics.median(times), "bytes": size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pages", type=int, default=10)
    ap.add_argument("--phase-s", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    proc, url = start_serve(args.model)
    try:
        model = httpx.get(url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
        load = Clients(url, 2, completion(model))
        time.sleep(10)  # warm up
        rows = []
        for _ in range(args.rounds):
            rows.append(phase(url, proc.pid, 0, args.phase_s, load))
            rows.append(phase(url, proc.pid, args.pages, args.phase_s, load))
        load.stop()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    cost = snapshot_cost()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| open pages | router CPU % | completions/s | JSON polls | JSON p50 ms | JSON p99 ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        p50 = "–" if r["p50_ms"] is None else f"{r['p50_ms']:.1f}"
        p99 = "–" if r["p99_ms"] is None else f"{r['p99_ms']:.1f}"
        print(f"| {r['pages']} | {r['cpu_pct']:.1f} | {r['done_per_s']:.2f} | {r['polls']} "
              f"| {p50} | {p99} |")  # fmt: skip
    print(f"\nsnapshot build in-process (8 workers, ring of 4096, 30 waterfall rows): "
          f"median {cost['build_ms']:.2f} ms, {cost['bytes']} bytes")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
