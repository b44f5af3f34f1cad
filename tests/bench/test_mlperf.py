"""`pdserve bench mlperf`: LoadGen's Server scenario through the OpenAI streaming endpoint, on a
fake server (the harness: every query answered, first tokens and token counts reported, the
limits reaching LoadGen, failures making the verdict INVALID) and, in the slow tier, on
`pdserve serve` with the tiny model and the knowledge-base QA prompts."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from factories import serving
from pdserve import cli
from pdserve.bench import mlperf

pytest.importorskip("mlperf_loadgen")  # a pdserve dependency; a missing wheel is a setup error


def _fake(seen: list[dict[str, Any]], fail: bool = False) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "fake"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        seen.append(body)
        if fail:
            return JSONResponse({"error": {"message": "down"}}, status_code=500)

        async def stream() -> AsyncIterator[str]:
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": " w"}]}) + "\n\n"
            usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    with serving(_fake(seen)) as url:
        yield url, seen


def _args(url: str, out: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    mlperf.add_arguments(parser)
    argv = ["--url", url, "--target-qps", "40", "--min-query-count", "12", "--min-duration-s",
            "0.3", "--output-len", "4", "--output-dir", str(out), *extra]  # fmt: skip
    return parser.parse_args(argv)


PROMPTS = ["What is a generator?", "How does with work?", "What is a decorator?"]


def test_server_scenario_answers_every_query_and_writes_the_logs(tmp_path, fake) -> None:  # type: ignore[no-untyped-def]
    url, seen = fake
    seen.clear()
    res = mlperf.run_loadgen(_args(url, tmp_path), PROMPTS)
    assert res["failed"] == [] and res["verdict"] in ("VALID", "INVALID")
    summary = (tmp_path / mlperf.SUMMARY).read_text()
    assert "Scenario : Server" in summary and f"Result is : {res['verdict']}" in summary
    assert "Min queries satisfied : Yes" in summary
    assert "Performance constraints satisfied : Yes" in summary  # 2 s TTFT, 200 ms TPOT
    detail = (tmp_path / mlperf.DETAIL).read_text()
    assert '"key": "requested_use_token_latencies", "value": true' in detail
    assert len(seen) >= 12 and {b["prompt"] for b in seen} <= set(PROMPTS)
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 4 for b in seen)


def test_the_latency_limits_reach_loadgen(tmp_path, fake) -> None:  # type: ignore[no-untyped-def]
    url, _ = fake
    res = mlperf.run_loadgen(_args(url, tmp_path, "--ttft-ms", "0.001"), PROMPTS)
    assert res["verdict"] == "INVALID"
    assert "Performance constraints satisfied : NO" in res["summary"]


def test_failed_queries_complete_and_make_it_invalid(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    seen: list[dict[str, Any]] = []
    with serving(_fake(seen, fail=True)) as url:
        res = mlperf.run_loadgen(_args(url, tmp_path), PROMPTS)
    assert res["verdict"] == "INVALID" and len(res["failed"]) == len(seen) >= 12
    assert "HTTP 500" in res["failed"][0]
    assert cli.main(["bench", "mlperf", "--url", "http://127.0.0.1:9", "--target-qps", "1",
                     "--output-dir", str(tmp_path)]) == 2  # fmt: skip
    assert "ConnectError" in capsys.readouterr().err


@pytest.mark.slow
def test_mlperf_against_pdserve_on_the_knowledge_base(tmp_path, tiny_llama_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from test_serve import Server

    srv = Server(str(tiny_llama_path), "--colocated", "1")
    try:
        argv = ["bench", "mlperf", "--url", srv.url, "--target-qps", "2", "--min-query-count",
                "6", "--min-duration-s", "2", "--input-len", "200", "--output-len", "8",
                "--output-dir", str(tmp_path)]  # fmt: skip
        code = cli.main(argv)
    finally:
        srv.stop()
    out = capsys.readouterr().out
    verdict = out.strip().splitlines()[-1]
    assert verdict in ("verdict: VALID", "verdict: INVALID")
    assert code == (0 if verdict.endswith(" VALID") else 1)
    assert "queries failed" not in out and "Min queries satisfied : Yes" in out
    assert (tmp_path / mlperf.SUMMARY).is_file() and (tmp_path / mlperf.DETAIL).is_file()
