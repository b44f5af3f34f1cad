"""What `bench sched` watches on a running pdserve: the worker table polled through a run
(roles, queues: role switches) and Prometheus text scraped before and after (deltas). Each
request's timeline comes from `harness.servers.fetch_timelines`."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx


class WorkerPoller:
    """GET /admin/workers every `interval` s in a thread, and once more at the end: samples of
    {t_s: seconds since the poller started (just before the load), workers: compact rows}."""

    def __init__(self, url: str, interval: float) -> None:
        self.url, self.interval = url, interval
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> WorkerPoller:
        """Starts polling; returns once the first poll (the state before the load) is done."""
        self._t0 = time.perf_counter()
        self._thread.start()
        self._first.wait(timeout=max(1.0, self.interval) + 1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=max(1.0, self.interval)) as client:
            while True:
                self._poll(client)
                self._first.set()
                if self._stop.wait(self.interval):
                    self._poll(client)  # the state at the end of the load
                    return

    def _poll(self, client: httpx.Client) -> None:
        t = time.perf_counter() - self._t0
        with contextlib.suppress(httpx.HTTPError, ValueError):
            rows = client.get(f"{self.url}/admin/workers").json()
            if isinstance(rows, list):
                self.samples.append({"t_s": round(t, 3), "workers": _compact(rows)})


def _compact(rows: list[Any]) -> list[dict[str, Any]]:
    keys = ("id", "role", "healthy", "queue", "running", "outstanding")
    return [{k: r.get(k) for k in keys if k in r} for r in rows if isinstance(r, dict)]


def role_switches(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Changes of a worker's role between consecutive polls: {t_s, worker, from, to}."""
    last: dict[str, Any] = {}
    out = []
    for s in samples:
        for row in s.get("workers", []):
            wid, role = row.get("id"), row.get("role")
            if wid is None or role is None:
                continue
            if wid in last and last[wid] != role:
                out.append({"t_s": s.get("t_s"), "worker": wid, "from": last[wid], "to": role})
            last[wid] = role
    return out


def parse_metrics(text: str) -> list[dict[str, Any]]:
    """pdserve_* samples of a Prometheus exposition, histogram buckets left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("pdserve_") and not s.name.endswith("_bucket"):
                out.append({"name": s.name, "labels": dict(s.labels), "value": float(s.value)})
    return out


def metrics_delta(
    before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """after - before per (name, labels) (a sample missing before counts from 0)."""

    def key(s: dict[str, Any]) -> tuple[str, tuple[tuple[str, str], ...]]:
        return s["name"], tuple(sorted(s["labels"].items()))

    base = {key(s): s["value"] for s in before}
    return [{**s, "value": s["value"] - base.get(key(s), 0.0)} for s in after]


def get(url: str, path: str) -> httpx.Response | None:
    try:
        return httpx.get(f"{url}{path}", timeout=10.0)
    except httpx.HTTPError:
        return None


def scrape_metrics(url: str) -> list[dict[str, Any]] | None:
    resp = get(url, "/metrics")
    if resp is None or resp.status_code != 200:
        return None
    try:
        return parse_metrics(resp.text)
    except ValueError:
        return None
