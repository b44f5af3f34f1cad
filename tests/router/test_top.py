"""`pdserve top --once` against the router app over the fake core: the same numbers as the
dashboard's JSON, in a terminal table; a clear error on a wrong key."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from fake_core import FakeCore
from fastapi.testclient import TestClient

from pdserve.cli import build_parser
from pdserve.metrics import Metrics
from pdserve.router.app import create_app
from pdserve.top import run

KEY = "sk-top"


@pytest.fixture
def client(default_tokenizer: Any) -> TestClient:
    core = FakeCore()
    core.worker_stats["D0"] = {"batch_requests": 5}
    app = create_app(
        core,
        default_tokenizer,
        model_name="fake",
        api_key=KEY,
        metrics=Metrics(slo_ttft_s=5.0, slo_tpot_s=1e-9),  # every multi-token request misses
    )
    c = TestClient(app)
    for _ in range(2):
        body = {"model": "fake", "prompt": "Hello", "max_tokens": 3}
        r = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
    return c


def args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["top", "--url", "http://testserver", "--once", *extra])


def test_top_once_prints_the_snapshot(client: TestClient, capsys: pytest.CaptureFixture) -> None:
    snap = client.get("/admin/dashboard.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert run(args("--api-key", KEY), client=client) == 0
    out = capsys.readouterr().out
    assert "pools" in out and "P0" in out and "D0" in out and "prefill" in out
    assert "ready" in out and "64" in out  # state, KV blocks total
    assert "ok 2" in out  # outcomes, as /metrics counts them
    rid = snap["requests"][0]["id"]
    assert rid[:24] in out  # the last requests
    assert "goodput/s" in out and "0.00" in out  # none met the TPOT SLO


def test_top_says_why_without_the_key(client: TestClient, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match=r"401 .*API key"):
        run(args(), client=client)
    from pdserve.cli import main

    # through the CLI: bad input is exit status 2 with a message, no traceback
    assert main(["top", "--url", "http://127.0.0.1:9", "--once", "--interval", "0"]) == 2
    assert "--interval must be > 0" in capsys.readouterr().err
