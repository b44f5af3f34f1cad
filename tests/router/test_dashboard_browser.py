"""The dashboard in a real browser: headless Chromium (Debian's `chromium`, which `make test`
installs) driven by Playwright loads /dashboard of a running `pdserve serve` (tiny model, real
workers) under load. The rendered page must show the workers, requests in the waterfall (one
clicked open), a role switch on the event line, and the same totals as /metrics (and so does
`pdserve top --once` against the same server); any console error, page error, failed load or
request to another host fails the test. A screenshot is saved under the test's temp dir (copy
it to docs/img/dashboard.png to refresh the docs' picture).

Slow (tests/conftest.py SLOW_MODULES). Never skipped: without chromium this test fails and says
how to install it.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from factories import die_with_parent

KEY = "sk-dashboard-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str:
    path = os.environ.get("PDSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail(
            "no chromium: `make test` installs it (apt-get install -y chromium); "
            "or set PDSERVE_CHROMIUM to a Chromium binary"
        )
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """`pdserve serve` on the tiny model, with an API key and SLOs (the page draws them)."""

    def __init__(self, model: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["serve", str(model), "--port", str(self.port), "--threads", "1"]
        args += ["--api-key", KEY, "--slo-ttft", "1.0", "--slo-tpot", "0.2"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *args],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready = select.select([self.proc.stdout], [], [], 1.0)[0]
            if ready and "serving" in self.proc.stdout.readline():
                return
        self.stop()
        raise RuntimeError(f"pdserve serve did not start (exit {self.proc.poll()})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


class Load:
    """Two client threads sending short completions until stopped."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.stop_flag = threading.Event()
        self.sent = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in (0, 1)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=60) as c:
            n = 0
            while not self.stop_flag.is_set():
                n += 1
                body = {
                    "model": self.model,
                    "prompt": f"request {i}-{n}: the quick brown fox " * (1 + n % 4),
                    "max_tokens": 8 + n % 8,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                c.post("/v1/completions", json=body)
                self.sent += 1

    def stop(self) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(60)


@pytest.fixture(scope="module")
def serve(tiny_llama_path: Path) -> Iterator[Serve]:
    srv = Serve(tiny_llama_path)
    yield srv
    srv.stop()


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"{name}{labels} not in /metrics")


def test_dashboard_in_chromium_under_load(serve: Serve, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    model = httpx.get(serve.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
    workers = httpx.get(serve.url + "/admin/workers", headers=AUTH).json()
    load = Load(serve.url, model)
    refused = httpx.post(
        serve.url + "/v1/completions", json={"model": model, "prompt": ""}, headers=AUTH
    )
    assert refused.status_code == 400  # a rejection by reason for the page to show
    problems: list[str] = []
    origin = urlsplit(serve.url).netloc
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1250})
            watch(page, origin, problems)
            page.goto(f"{serve.url}/dashboard#key={KEY}")
            rows = page.locator("#workers tbody tr[data-worker]")
            rows.first.wait_for(timeout=20_000)
            assert rows.count() == len(workers) == 2
            assert {r.get_attribute("data-worker") for r in rows.all()} == {
                w["id"] for w in workers
            }
            assert page.url.endswith("/dashboard")  # the key left the address bar
            page.locator("#waterfall .req[data-rid]").first.wait_for(timeout=60_000)
            page.locator("#waterfall .req [data-stage=prefill]").first.wait_for(timeout=30_000)
            switch_roles(serve.url, workers)
            page.locator("#events tr[data-kind=role_switch]").first.wait_for(timeout=30_000)
            page.locator("#ttft path[data-series=ttft_p90]").wait_for(timeout=30_000)
            time.sleep(3)  # a few more refreshes under load for the picture
            page.screenshot(path=str(tmp_path / "dashboard-load.png"), full_page=True)
            load.stop()
            check_totals(page, serve.url)
            open_timeline(page)
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            browser.close()
    finally:
        load.stop()
    assert load.sent > 0
    assert not problems, problems
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    check_top(serve.url, workers)


def check_top(url: str, workers: list[dict[str, Any]]) -> None:
    """`pdserve top --once` against the same server prints the same workers and totals."""
    cmd = [sys.executable, "-m", "pdserve.cli", "top", "--once", "--url", url, "--api-key", KEY]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert all(w["id"] in out.stdout for w in workers), out.stdout
    ok = int(metric(url, "pdserve_requests_total", outcome="ok"))
    assert f"ok {ok}" in out.stdout, out.stdout


def watch(page: Any, origin: str, problems: list[str]) -> None:
    """Record console errors, page errors, failed loads and requests to another host."""

    def on_request(req: Any) -> None:
        url = urlsplit(req.url)
        if url.scheme not in ("data", "about") and url.netloc != origin:
            problems.append(f"request to another host: {req.url}")

    page.on("request", on_request)
    page.on(
        "console",
        lambda msg: (
            problems.append(f"console {msg.type}: {msg.text}") if msg.type == "error" else None
        ),
    )
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("requestfailed", lambda req: problems.append(f"failed: {req.url} {req.failure}"))


def switch_roles(url: str, workers: list[dict[str, Any]]) -> None:
    """Move the prefill worker to decode and back (admin API): two events on the time line."""
    p = next(w["id"] for w in workers if w["role"] == "prefill")
    for role in ("decode", "prefill"):
        r = httpx.post(
            f"{url}/admin/workers/{p}/role", json={"role": role}, headers=AUTH, timeout=120
        )
        assert r.status_code == 200, r.text


def check_totals(page: Any, url: str) -> None:
    """Once the load stopped, the page's totals settle on exactly /metrics' numbers."""
    ok = metric(url, "pdserve_requests_total", outcome="ok")
    remote = metric(url, "pdserve_route_decisions_total", route="remote")
    assert ok > 0 and remote > 0
    page.wait_for_function(
        "want => document.getElementById('kpi-ok').textContent === want",
        arg=str(int(ok)),
        timeout=15_000,
    )
    shown = page.locator("#routes [data-key=remote] .v").get_attribute("data-value")
    assert shown is not None and float(shown) == remote
    rejected = metric(url, "pdserve_request_rejections_total", code="empty_prompt")
    shown = page.locator("#rejections [data-key=empty_prompt] .v").get_attribute("data-value")
    assert shown is not None and float(shown) == rejected == 1
    tokens = metric(url, "pdserve_generation_tokens_total")
    assert page.locator("#kpi-tokens").text_content() == str(int(tokens))


def open_timeline(page: Any) -> None:
    row = page.locator("#waterfall .req[data-rid]").first
    rid = row.get_attribute("data-rid")
    row.click()
    body = page.locator("#detail-body")
    page.wait_for_function(
        "() => document.getElementById('detail-body').textContent.includes('finish')",
        timeout=10_000,
    )
    text = body.text_content() or ""
    assert "arrive" in text and "prefill_start" in text, text
    assert page.locator("#detail-title").text_content() == f"Timeline of {rid}"
