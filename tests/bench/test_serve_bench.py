"""`pdserve bench serve` against a tiny fake OpenAI-compatible streaming server (FastAPI +
uvicorn in a thread on a free port), and the workloads on their own.

No timing assertions beyond sanity (TTFT < E2E, goodput <= request throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from factories import serving
from pdserve.bench.load import client, summary
from pdserve.bench.load import serve_bench as sb
from pdserve.workloads import streams as wl
from pdserve.workloads.spec import LoadSpec
from pdserve.workloads.streams import (
    ID_HIGH,
    ID_LOW,
    MixedWorkload,
    MultiTurnWorkload,
    RequestItem,
    ShiftingWorkload,
    SyntheticWorkload,
    ids_to_text,
    make_workload,
)

FAIL_ID = 7  # a prompt starting with this id gets HTTP 500
SSE_ERROR_ID = 8  # ... an SSE error event mid-stream
REJECT_ID = 9  # ... HTTP 429, an OpenAI error envelope with code "slo_ttft", Retry-After: 2
OVERLOAD_ID = 10  # ... HTTP 503, a plain-text body, no Retry-After
MODEL = "fake-model"


def _app(seen: list[dict[str, Any]]) -> Any:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        seen.append(body)
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and prompt[0] == FAIL_ID:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if isinstance(prompt, list) and prompt and prompt[0] == REJECT_ID:
            err = {"message": "predicted TTFT misses the SLO", "type": "rate_limit_exceeded",
                   "param": None, "code": "slo_ttft"}  # fmt: skip
            return JSONResponse({"error": err}, status_code=429, headers={"Retry-After": "2"})
        if isinstance(prompt, list) and prompt and prompt[0] == OVERLOAD_ID:
            return PlainTextResponse("overloaded", status_code=503)
        n = int(body["max_tokens"])
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())

        async def stream() -> AsyncIterator[str]:
            for i in range(n):
                await asyncio.sleep(0.002)
                if i == 1 and isinstance(prompt, list) and prompt[0] == SSE_ERROR_ID:
                    yield "data: " + json.dumps({"error": {"message": "engine died"}}) + "\n\n"
                    return
                finish = "length" if i == n - 1 else None
                choice = {"index": 0, "text": f" t{i}", "finish_reason": finish}
                chunk = {"object": "text_completion", "model": MODEL, "choices": [choice]}
                yield "data: " + json.dumps(chunk) + "\n\n"
            usage = {
                "prompt_tokens": n_prompt,
                "completion_tokens": n,
                "total_tokens": n_prompt + n,
            }
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    with serving(_app(seen)) as url:
        yield url, seen


def _args(url: str, *extra: str) -> LoadSpec:
    """The spec `bench serve` builds from these flags (its own parser, then `from_args`)."""
    parser = argparse.ArgumentParser()
    sb.add_arguments(parser)
    argv = ["--url", url, "--input-len", "16", "--output-len", "6", "--no-progress", *extra]
    return LoadSpec.from_args(parser.parse_args(argv))


class _WithFailures:
    """Synthetic items, with request 3 -> HTTP 500 and request 5 -> SSE error event."""

    name = "synthetic"

    def __init__(self, n: int) -> None:
        self.items = list(SyntheticWorkload(n, 16, 6, 0.5, seed=1))
        for i, bad in ((3, FAIL_ID), (5, SSE_ERROR_ID)):
            it = self.items[i]
            self.items[i] = RequestItem([bad, *it.prompt[1:]], it.max_tokens, it.conversation)

    def __iter__(self) -> Iterator[RequestItem]:
        return iter(self.items)


def _check_result(res: dict[str, Any], n: int) -> None:
    keys = "completed failed duration_s request_throughput output_throughput input_throughput"
    for key in [*keys.split(), "goodput", "good_fraction", "errors", "config", "requests"]:
        assert key in res, key
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(res[key]) == {"mean", "p50", "p90", "p99"}
        s = res[key]
        assert 0 < s["p50"] <= s["p99"], (key, s)
    assert res["completed"] + res["failed"] == n == len(res["requests"])
    assert res["duration_s"] > 0
    assert 0 <= res["goodput"] <= res["request_throughput"] + 1e-12
    assert 0.0 <= res["good_fraction"] <= res["completed"] / n
    assert res["output_throughput"] > 0 and res["input_throughput"] > 0
    assert res["ttft_ms"]["mean"] < res["e2e_ms"]["mean"]
    for r in res["requests"]:
        assert set(r) >= {"send_s", "ttft_ms", "e2e_ms", "output_tokens", "error"}
        if r["error"] is None:
            assert 0 < r["ttft_ms"] < r["e2e_ms"]
            assert r["output_tokens"] == r["max_tokens"]
            assert r["tpot_ms"] > 0
        else:
            assert r["ttft_ms"] is None and r["e2e_ms"] is None
    sends = [r["send_s"] for r in res["requests"]]
    assert sends == sorted(sends) and sends[0] >= 0


def test_rate_mode_counts_failures_and_fields(server: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = server
    n = 12
    args = _args(url, "--rate", "200", "--burstiness", "0.5", "--num-requests", str(n))
    before = len(seen)
    res = asyncio.run(sb.run_benchmark(args, workload=_WithFailures(n)))
    _check_result(res, n)
    assert res["completed"] == n - 2 and res["failed"] == 2
    assert len(res["errors"]) == 2
    assert any(e.startswith("HTTP 500") and "boom" in e for e in res["errors"])
    assert any("SSE error" in e and "engine died" in e for e in res["errors"])
    assert res["good_fraction"] == pytest.approx((n - 2) / n)  # no SLO: every completed is good
    assert res["goodput"] == pytest.approx(res["request_throughput"])
    assert res["config"]["model"] == MODEL and res["config"]["rate"] == 200
    body = seen[before]
    assert body["model"] == MODEL and body["stream"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert all(isinstance(t, int) for t in body["prompt"])


def test_concurrency_mode_cli_with_slos_writes_json(
    server: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    url, seen = server
    out = tmp_path / "res.json"
    before = len(seen)
    argv = ["--url", url, "--concurrency", "3", "--num-requests", "9", "--input-len", "16",
            "--output-len", "5", "--len-spread", "0.5", "--slo-ttft", "1e-9", "--seed", "3",
            "--no-ignore-eos", "--prompt-format", "text", "--model", "m",
            "--result-json", str(out), "--no-progress"]  # fmt: skip
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = sb.main(argv)
    assert rc == 0
    res = json.loads(out.read_text())
    _check_result(res, 9)
    assert res["completed"] == 9 and res["failed"] == 0 and res["errors"] == []
    # an impossible TTFT SLO: nothing is good
    assert res["goodput"] == 0 and res["good_fraction"] == 0
    cfg = res["config"]
    assert cfg["concurrency"] == 3 and cfg["rate"] is None and cfg["slo_ttft_s"] == 1e-9
    assert cfg["num_requests"] == 9 and cfg["seed"] == 3 and cfg["model"] == "m"
    bodies = seen[before:]
    assert len(bodies) == 9
    assert all(isinstance(b["prompt"], str) and "ignore_eos" not in b for b in bodies)
    assert all(b["model"] == "m" for b in bodies)
    table = stdout.getvalue()
    for word in ("completed 9", "TTFT", "TPOT", "ITL", "E2E", "goodput"):
        assert word in table


def test_concurrency_cap_is_respected(server: tuple[str, list[dict[str, Any]]]) -> None:
    url, _ = server
    args = _args(url, "--concurrency", "2", "--num-requests", "8")
    res = asyncio.run(sb.run_benchmark(args))
    _check_result(res, 8)
    spans = [(r["send_s"], r["send_s"] + r["e2e_ms"] / 1e3) for r in res["requests"]]
    # at each send, at most 1 other request may still be streaming content (cap 2)
    for s, _ in spans:
        assert sum(a < s < b for a, b in spans) <= 1


def test_multiturn_turns_are_sequential(server: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = server
    args = _args(url, "--workload", "multiturn", "--turns", "3", "--rate", "inf",
                 "--num-requests", "7", "--multiturn-answers", "placeholder")  # fmt: skip
    before = len(seen)
    res = asyncio.run(sb.run_benchmark(args))
    _check_result(res, 7)
    assert res["config"]["workload"] == "multiturn" and res["config"]["turns"] == 3
    by_conv: dict[int, list[dict[str, Any]]] = {}
    for r in res["requests"]:
        by_conv.setdefault(r["conversation"], []).append(r)
    assert sorted(len(v) for v in by_conv.values()) == [1, 3, 3]
    for turns in by_conv.values():
        assert [r["turn"] for r in turns] == list(range(len(turns)))
        for prev, cur in itertools.pairwise(turns):
            assert cur["send_s"] >= prev["send_s"] + prev["e2e_ms"] / 1e3
    # the first sends are the first turn of every conversation (interleaved, not one by one)
    assert [r["turn"] for r in res["requests"][:3]] == [0, 0, 0]
    assert len(seen) - before == 7


def test_multiturn_turn_counts_in_a_range_think_time_and_ttft_by_turn(
    server: tuple[str, list[dict[str, Any]]],
) -> None:
    url, _ = server
    args = _args(url, "--workload", "multiturn", "--turns-range", "3,5", "--rate", "inf",
                 "--num-requests", "12", "--multiturn-answers", "placeholder",
                 "--think-time", "0.05", "--think-dist", "fixed")  # fmt: skip
    res = asyncio.run(sb.run_benchmark(args))
    _check_result(res, 12)
    by_conv: dict[int, list[dict[str, Any]]] = {}
    for r in res["requests"]:
        by_conv.setdefault(r["conversation"], []).append(r)
    *whole, last = [len(v) for _, v in sorted(by_conv.items())]
    assert all(3 <= n <= 5 for n in whole) and 1 <= last <= 5
    for turns in by_conv.values():
        for prev, cur in itertools.pairwise(turns):  # the next turn waits out the think time
            assert cur["send_s"] >= prev["send_s"] + prev["e2e_ms"] / 1e3 + 0.049
    assert set(res["by_phase"]) == {"turn 1", "turns 2+"}
    assert res["by_phase"]["turn 1"]["sent"] == len(by_conv)
    assert res["by_phase"]["turns 2+"]["ttft_ms"]["p50"] is not None
    assert list(res["config"]["turns_range"]) == [3, 5]


def test_unreachable_server_is_an_error() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = sb.main(["--url", f"http://127.0.0.1:{port}", "--rate", "1", "--num-requests", "1"])
    assert rc == 2 and "error" in err.getvalue()


def test_all_failed_returns_nonzero(server: tuple[str, list[dict[str, Any]]]) -> None:
    url, _ = server
    args = _args(url, "--concurrency", "2", "--num-requests", "2", "--model", "m")
    wl = _WithFailures(6)
    wl.items = [wl.items[3], wl.items[3]]
    res = asyncio.run(sb.run_benchmark(args, workload=wl))
    assert res["completed"] == 0 and res["failed"] == 2 and res["errors"] == [res["errors"][0]]
    assert res["ttft_ms"]["mean"] is None and res["goodput"] == 0 and res["good_fraction"] == 0


def test_synthetic_workload_is_seeded_with_spread() -> None:
    a = list(SyntheticWorkload(50, 100, 20, 0.5, seed=4))
    b = list(SyntheticWorkload(50, 100, 20, 0.5, seed=4))
    c = list(SyntheticWorkload(50, 100, 20, 0.5, seed=5))
    assert a == b and a != c
    assert all(50 <= len(it.prompt) <= 150 and 10 <= it.max_tokens <= 30 for it in a)
    assert len({len(it.prompt) for it in a}) > 1
    assert all(ID_LOW <= t < ID_HIGH for it in a for t in it.prompt)
    assert len({it.conversation for it in a}) == 50
    fixed = list(SyntheticWorkload(5, 100, 20, 0.0, seed=0))
    assert {len(it.prompt) for it in fixed} == {100} and {it.max_tokens for it in fixed} == {20}


def test_multiturn_prompts_share_a_growing_prefix() -> None:
    items = list(MultiTurnWorkload(8, 10, 4, 0.0, seed=0, turns=3))
    assert [(it.conversation, it.turn) for it in items] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)
    ]  # fmt: skip
    for prev, cur in itertools.pairwise(items):
        if cur.turn:
            assert cur.prompt[: len(prev.prompt)] == prev.prompt
            assert len(cur.prompt) == len(prev.prompt) + prev.max_tokens + 10
    assert items[3].prompt[:10] != items[0].prompt[:10]
    text = [ids_to_text(it.prompt) for it in items[:2]]
    assert text[1].startswith(text[0] + " ")


def test_arrival_gaps_mean_and_inf() -> None:
    gaps = sb.arrival_gaps(10.0, 1.0, 4000, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    bursty = sb.arrival_gaps(10.0, 0.25, 4000, seed=0)
    assert sum(bursty) / len(bursty) == pytest.approx(0.1, rel=0.2)
    assert sb.arrival_gaps(float("inf"), 1.0, 3, seed=0) == [0.0, 0.0, 0.0]


def test_arrival_gaps_spread_follows_burstiness() -> None:
    # gamma(shape k): coefficient of variation 1/sqrt(k): Poisson 1, k=0.25 -> 2, k=4 -> 0.5
    for k, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        gaps = np.asarray(sb.arrival_gaps(5.0, k, 20000, seed=3))
        assert gaps.mean() == pytest.approx(0.2, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08), k


def _rec(i: int, ttft: float | None, tpot: float | None, out: int = 5, error: str | None = None):  # type: ignore[no-untyped-def]
    e2e = None if ttft is None else ttft + (tpot or 0.0) * (out - 1)
    itl = [tpot] * (out - 1) if tpot else []
    return summary.RequestRecord(
        i, i, 0, 10, out, send_s=0.1 * i, output_tokens=out if error is None else 0,
        ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e, error=error, itl_ms=itl,
    )  # fmt: skip


def test_summarize_known_answers() -> None:
    records = [
        _rec(0, 100.0, 10.0),
        _rec(1, 200.0, 20.0),
        _rec(2, 300.0, 30.0),
        _rec(3, 400.0, 40.0),
        _rec(4, None, None, error="HTTP 503: busy"),
    ]
    args = _args("http://x", "--rate", "1", "--num-requests", "5", "--slo-ttft", "0.25",
                 "--slo-tpot", "0.025")  # fmt: skip
    res = summary.summarize(args, MODEL, "synthetic", records, duration=2.0)
    assert res["completed"] == 4 and res["failed"] == 1 and res["errors"] == ["HTTP 503: busy"]
    assert res["ttft_ms"] == {"mean": 250.0, "p50": 250.0, "p90": 370.0, "p99": 397.0}
    assert res["tpot_ms"]["mean"] == 25.0 and res["tpot_ms"]["p50"] == 25.0
    assert res["itl_ms"]["mean"] == pytest.approx(25.0)  # 4 gaps of each request, pooled
    assert res["e2e_ms"]["p50"] == pytest.approx(350.0)  # e2e 140, 280, 420, 560
    # good: ttft <= 250 ms and tpot <= 25 ms -> requests 0 and 1
    assert res["good"] == 2 and res["goodput"] == 1.0 and res["good_fraction"] == 2 / 5
    assert res["request_throughput"] == 2.0 and res["output_throughput"] == 10.0


def test_backends_ask_for_exact_lengths_in_their_dialect() -> None:
    item = RequestItem([5, 6, 7], 9, 0, text="<|im_start|>user\nhi<|im_end|>\n")
    for backend, check in (
        ("pdserve", lambda p: p["ignore_eos"] is True),
        ("llama-cpp", lambda p: p["min_tokens"] == 9 and "ignore_eos" not in p),
        ("transformers", lambda p: json.loads(p["generation_config"]) ==
         {"max_new_tokens": 9, "min_new_tokens": 9, "do_sample": False}),
    ):  # fmt: skip
        args = _args("http://x", "--rate", "1", "--num-requests", "1", "--backend", backend)
        payload = client.payload(args, MODEL, item)
        assert check(payload), backend
        assert payload["prompt"] == item.text and payload["max_tokens"] == 9
    args = _args("http://x", "--rate", "1", "--num-requests", "1", "--no-ignore-eos")
    payload = client.payload(args, MODEL, RequestItem([5, 6], 3, 0))
    assert payload["prompt"] == [5, 6] and "ignore_eos" not in payload


# ---------------------------------------------------------------------------- rejections


class _Marked:
    """Synthetic items whose prompts start with a sentinel id at the given indexes."""

    name = "synthetic"

    def __init__(self, n: int, marks: dict[int, int]) -> None:
        self.items = list(SyntheticWorkload(n, 16, 6, 0.0, seed=2))
        for i, mark in marks.items():
            it = self.items[i]
            self.items[i] = RequestItem([mark, *it.prompt[1:]], it.max_tokens, it.conversation)

    def __iter__(self) -> Iterator[RequestItem]:
        return iter(self.items)


def test_rejections_are_results_not_errors(server: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = server
    n = 10
    marks = {1: REJECT_ID, 4: REJECT_ID, 6: OVERLOAD_ID, 8: FAIL_ID}
    args = _args(url, "--rate", "inf", "--num-requests", str(n), "--slo-ttft", "60",
                 "--slo-tpot", "60")  # fmt: skip
    before = len(seen)
    res = asyncio.run(sb.run_benchmark(args, workload=_Marked(n, marks)))
    # each request was sent exactly once: a 429/503 is never retried by the client
    assert len(seen) - before == n
    assert res["sent"] == n and res["rejected"] == 3 and res["admitted"] == 7
    assert res["rejected_by_code"] == {"http_503": 1, "slo_ttft": 2}
    assert res["failed"] == 1 and res["completed"] == 6  # the HTTP 500 is the only error
    assert len(res["errors"]) == 1 and res["errors"][0].startswith("HTTP 500")
    assert res["good"] == 6  # loose SLOs: every completed request is good
    assert res["slo_attainment"] == pytest.approx(6 / 10)
    assert res["good_fraction"] == pytest.approx(6 / 10)
    assert res["slo_attainment_admitted"] == pytest.approx(6 / 7)
    rl = res["rejection_latency_ms"]
    assert rl["p50"] is not None and 0 < rl["p50"] <= rl["p99"] < 5000
    assert res["retry_after_s"]["p50"] == 2.0
    by_index = {r["id"]: r for r in res["requests"]}
    for i, code, retry in ((1, "slo_ttft", 2.0), (6, "http_503", None)):
        r = by_index[i]
        assert r["rejected"] and r["reject_code"] == code and r["retry_after_s"] == retry
        assert r["error"] is None and r["ttft_ms"] is None and r["reject_ms"] > 0
    assert not by_index[0]["rejected"] and by_index[0]["reject_ms"] is None
    table = summary.format_table(res)
    assert "rejected 3 (http_503 1, slo_ttft 2)" in table and "rejection latency" in table


def test_user_field_names_the_conversation(server: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = server
    args = _args(url, "--rate", "inf", "--num-requests", "3")
    before = len(seen)
    res = asyncio.run(sb.run_benchmark(args))
    assert sorted(b["user"] for b in seen[before:]) == ["conv-0", "conv-1", "conv-2"]
    assert sorted(r["user"] for r in res["requests"]) == ["conv-0", "conv-1", "conv-2"]
    args = _args(url, "--rate", "inf", "--num-requests", "2", "--no-send-user")
    before = len(seen)
    asyncio.run(sb.run_benchmark(args))
    assert all("user" not in b for b in seen[before:])


def _row(i: int, **kw: Any) -> dict[str, Any]:
    base = {"id": i, "send_s": float(i), "error": None, "rejected": False, "ttft_ms": 100.0,
            "tpot_ms": 10.0, "e2e_ms": 500.0, "reject_ms": None, "phase": None}  # fmt: skip
    return {**base, **kw}


def test_outcome_summary_known_answers() -> None:
    rows = [
        _row(0),
        _row(1, ttft_ms=900.0),  # misses TTFT
        _row(2, rejected=True, reject_code="slo_tpot", reject_ms=2.0, retry_after_s=1.0,
             ttft_ms=None, tpot_ms=None, e2e_ms=None),
        _row(3, rejected=True, reject_code="slo_ttft", reject_ms=4.0, ttft_ms=None,
             tpot_ms=None, e2e_ms=None),
        _row(4, error="HTTP 500", ttft_ms=None, tpot_ms=None, e2e_ms=None),
    ]  # fmt: skip
    out = summary.outcome_summary(rows, slo_ttft=0.5, slo_tpot=0.02, duration=2.0)
    assert (out["sent"], out["admitted"], out["rejected"], out["failed"]) == (5, 3, 2, 1)
    assert out["completed"] == 2 and out["good"] == 1 and out["goodput"] == 0.5
    assert out["slo_attainment"] == pytest.approx(1 / 5)
    assert out["slo_attainment_admitted"] == pytest.approx(1 / 3)
    assert out["rejected_by_code"] == {"slo_ttft": 1, "slo_tpot": 1}
    assert out["rejection_latency_ms"]["p50"] == 3.0
    assert out["retry_after_s"]["p50"] == 1.0
    # default span: first send (0) -> last answer (request 1: 1 s + 0.5 s)
    assert summary.outcome_summary(rows, None, None)["span_s"] == pytest.approx(4.0)
    # nothing admitted: attainment of admitted is undefined, not 0
    assert summary.outcome_summary(rows[2:4], 0.5, 0.02)["slo_attainment_admitted"] is None
    # older records without the new fields still work
    old = [{"error": None, "ttft_ms": 1.0, "tpot_ms": 1.0, "send_s": 0.0, "e2e_ms": 5.0}]
    assert summary.outcome_summary(old, 1.0, 1.0)["good"] == 1


def test_by_phase_splits_and_spans() -> None:
    rows = [
        _row(0, phase="prefill-heavy"),
        _row(1, phase="prefill-heavy", ttft_ms=5000.0),
        _row(2, phase="decode-heavy"),
        _row(3, phase="decode-heavy"),
    ]
    out = summary.by_phase(rows, slo_ttft=1.0, slo_tpot=None)
    assert list(out) == ["prefill-heavy", "decode-heavy"]
    pre, dec = out["prefill-heavy"], out["decode-heavy"]
    assert pre["good"] == 1 and dec["good"] == 2
    assert pre["span_s"] == pytest.approx(1.0 + 0.5)  # send 0 -> request 1 ends at 1.5
    assert dec["span_s"] == pytest.approx(1.5) and dec["goodput"] == pytest.approx(2 / 1.5)
    assert summary.by_phase([_row(0)], None, None) == {}


# ---------------------------------------------------------------------------- multiturn answers


def _by_conv(bodies: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for b in bodies:
        out.setdefault(b["user"], []).append(b)
    return out


def test_multiturn_text_prompt_carries_the_actual_answer(
    server: tuple[str, list[dict[str, Any]]],
) -> None:
    url, seen = server
    args = _args(url, "--workload", "multiturn", "--turns", "3", "--rate", "inf",
                 "--num-requests", "5", "--prompt-format", "text", "--output-len", "3",
                 "--seed", "5")  # fmt: skip
    before = len(seen)
    res = asyncio.run(sb.run_benchmark(args))
    assert res["completed"] == 5 and res["config"]["multiturn_answers"] == "actual"
    items = list(MultiTurnWorkload(5, 16, 3, 0.0, seed=5, turns=3, answers="actual"))
    convs = _by_conv(seen[before:])
    for conv, bodies in convs.items():
        questions = [it.question for it in items if f"conv-{it.conversation}" == conv]
        assert bodies[0]["prompt"] == ids_to_text(questions[0] or [])
        for t in range(1, len(bodies)):
            prev = bodies[t - 1]
            answer = "".join(f" t{i}" for i in range(prev["max_tokens"]))  # the fake's text
            assert (
                bodies[t]["prompt"] == f"{prev['prompt']}{answer} {ids_to_text(questions[t] or [])}"
            )
    # the record's prompt length is the length actually sent (words)
    for r in res["requests"]:
        assert r["prompt_len"] == len(convs[r["user"]][r["turn"]]["prompt"].split())


class _Encoder:
    """A fake tokenizer: one id per word, 500 + its length."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [500 + len(w) for w in text.split()]


def test_multiturn_ids_prompt_carries_the_reencoded_answer(
    server: tuple[str, list[dict[str, Any]]],
) -> None:
    url, seen = server
    args = _args(url, "--workload", "multiturn", "--turns", "2", "--rate", "inf",
                 "--num-requests", "4", "--output-len", "3")  # fmt: skip
    before = len(seen)
    res = asyncio.run(sb.run_benchmark(args, encoder=_Encoder()))
    assert res["completed"] == 4
    items = list(MultiTurnWorkload(4, 16, 3, 0.0, seed=0, turns=2, answers="actual"))
    for conv, bodies in _by_conv(seen[before:]).items():
        first, second = bodies
        c = int(conv.removeprefix("conv-"))
        q0, q1 = (it.question for it in items if it.conversation == c)
        assert first["prompt"] == q0
        # " t0 t1 t2" -> three words of length 2
        assert second["prompt"] == [*first["prompt"], 502, 502, 502, *(q1 or [])]


def test_multiturn_after_a_rejected_turn_carries_no_answer() -> None:
    convs = sb._Conversations(text=False, encoder=_Encoder())
    first = RequestItem([1, 2], 3, conversation=0, turn=0, question=[1, 2])
    second = RequestItem([1, 2, 0, 0, 0, 3], 3, conversation=0, turn=1, question=[3])
    p0 = convs.prompt(first)
    convs.finished(first, p0, "")  # rejected: no answer
    assert convs.prompt(second) == [1, 2, 3]
    text = sb._Conversations(text=True, encoder=None)
    p0 = text.prompt(first)
    text.finished(first, p0, " hello")
    assert text.prompt(second) == f"{ids_to_text([1, 2])} hello {ids_to_text([3])}"


def test_multiturn_workload_actual_mode_keeps_the_placeholder_prompts() -> None:
    placeholder = list(MultiTurnWorkload(6, 10, 4, 0.2, seed=1, turns=3))
    actual = list(MultiTurnWorkload(6, 10, 4, 0.2, seed=1, turns=3, answers="actual"))
    assert [it.prompt for it in placeholder] == [it.prompt for it in actual]
    assert all(it.question is None for it in placeholder)
    for it in actual:
        assert it.question is not None and it.prompt[-len(it.question) :] == it.question
        if it.turn == 0:
            assert it.prompt == it.question
    with pytest.raises(ValueError, match="answers"):
        MultiTurnWorkload(2, 4, 4, 0.0, seed=0, turns=2, answers="maybe")


# ---------------------------------------------------------------------------- mixed, shifting


def test_mixed_workload_is_seeded_within_bounds() -> None:
    a = list(MixedWorkload(200, seed=3, long_fraction=0.3))
    assert a == list(MixedWorkload(200, seed=3, long_fraction=0.3))
    assert a != list(MixedWorkload(200, seed=4, long_fraction=0.3))
    longs = [it for it in a if it.phase == "long"]
    shorts = [it for it in a if it.phase == "short"]
    assert len(longs) + len(shorts) == 200 and 40 <= len(longs) <= 80
    assert all(1500 <= len(it.prompt) <= 2000 for it in longs)
    assert all(64 <= len(it.prompt) <= 200 for it in shorts)
    assert all(16 <= it.max_tokens <= 64 for it in a)
    assert len({it.conversation for it in a}) == 200
    assert all(ID_LOW <= t < ID_HIGH for it in a[:5] for t in it.prompt)
    none = list(MixedWorkload(20, seed=0, long_fraction=0.0, short_len=(5, 5), output_len=(2, 3)))
    assert {len(it.prompt) for it in none} == {5} and {it.phase for it in none} == {"short"}
    with pytest.raises(ValueError):
        MixedWorkload(3, seed=0, long_fraction=1.5)


def test_shifting_workload_phases_by_index_and_time() -> None:
    kw = {"phase1_input": (50, 60), "phase1_output": (2, 3), "phase2_input": (4, 8),
          "phase2_output": (20, 30)}  # fmt: skip
    items = list(ShiftingWorkload(10, seed=1, shift_at=4, **kw))  # type: ignore[arg-type]
    assert [it.phase for it in items] == ["prefill-heavy"] * 4 + ["decode-heavy"] * 6
    for it in items:
        if it.phase == "prefill-heavy":
            assert 50 <= len(it.prompt) <= 60 and 2 <= it.max_tokens <= 3
        else:
            assert 4 <= len(it.prompt) <= 8 and 20 <= it.max_tokens <= 30
    assert [it.conversation for it in items] == list(range(10))
    assert items == list(ShiftingWorkload(10, seed=1, shift_at=4, **kw))  # type: ignore[arg-type]
    default = ShiftingWorkload(10, seed=1, **kw)  # type: ignore[arg-type]
    assert default.item_at is None and default.shift_at == 5
    timed = ShiftingWorkload(10, seed=1, shift_at_s=2.0, **kw)  # type: ignore[arg-type]
    assert timed.item_at is not None
    # the same items whatever the boundary: index 6 before 2 s is phase 1's, after it phase 2's
    assert timed.item_at(6, 1.9) == list(ShiftingWorkload(10, seed=1, shift_at=10, **kw))[6]  # type: ignore[arg-type]
    assert timed.item_at(6, 2.0) == items[6]
    with pytest.raises(ValueError):
        ShiftingWorkload(3, seed=0, shift_at=4)


def test_new_workloads_are_registered_with_their_flags() -> None:
    args = _args("http://x", "--rate", "1", "--num-requests", "12", "--workload", "mixed",
                 "--short-len", "10,12", "--long-len", "30", "--long-fraction", "0.5",
                 "--mixed-output-len", "1,2")  # fmt: skip
    items = list(make_workload(args))
    assert {len(it.prompt) for it in items} <= {10, 11, 12, 30}
    args = _args("http://x", "--rate", "1", "--num-requests", "6", "--workload", "shifting",
                 "--phase1-input-len", "40,41", "--phase2-output-len", "9",
                 "--shift-at", "2")  # fmt: skip
    items = list(make_workload(args))
    assert [it.phase for it in items] == ["prefill-heavy"] * 2 + ["decode-heavy"] * 4
    assert all(it.max_tokens == 9 for it in items[2:])
    assert {"mixed", "shifting"} <= set(wl.WORKLOADS) and "shifting" in wl.WORKLOAD_ARGUMENTS
    for bad in (["--short-len", "5,3"], ["--long-len", "a,b"], ["--long-fraction", "2"],
                ["--shift-at", "1", "--shift-at-s", "1"], ["--long-len", "0,4"]):  # fmt: skip
        with pytest.raises(SystemExit):
            _args("http://x", "--rate", "1", "--num-requests", "1", *bad)
    assert wl.length_range("7") == (7, 7) and wl.length_range(" 3, 9") == (3, 9)


def test_shifting_by_time_through_the_generator(server: tuple[str, list[dict[str, Any]]]) -> None:
    url, _ = server
    base = ["--workload", "shifting", "--rate", "inf", "--num-requests", "4",
            "--phase1-input-len", "8", "--phase1-output-len", "2", "--phase2-input-len", "4",
            "--phase2-output-len", "3"]  # fmt: skip
    res = asyncio.run(sb.run_benchmark(_args(url, *base, "--shift-at-s", "0")))
    assert {r["phase"] for r in res["requests"]} == {"decode-heavy"}
    assert all(r["max_tokens"] == 3 and r["prompt_len"] == 4 for r in res["requests"])
    res = asyncio.run(sb.run_benchmark(_args(url, *base, "--shift-at-s", "3600")))
    assert {r["phase"] for r in res["requests"]} == {"prefill-heavy"}
    assert list(res["by_phase"]) == ["prefill-heavy"]
    assert res["by_phase"]["prefill-heavy"]["sent"] == 4
