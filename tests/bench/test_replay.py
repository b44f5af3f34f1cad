"""Production traces (workloads/traces.py) and `pdserve bench replay`: each parser on the real
files' first lines (tests/bench/traces/) and on small files made here, the scaling and
windowing, the expected prefix reuse, block synthesis (same ids, same tokens; different ids,
different ones), the replay against a fake server (payloads, timing, /metrics deltas) and, in
the slow tier, against `pdserve serve` on the tiny model (its measured prefix hits beside the
trace's)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from factories import serving
from pdserve import cli
from pdserve.bench.load import replay
from pdserve.bench.load.trace_text import BlockText
from pdserve.workloads import traces as tr

# the real files' first lines, kept beside the tests (traces/README.md names the sources)
TRACES = Path(__file__).resolve().parent / "traces"
MOONCAKE = TRACES / "mooncake_conversation_head.jsonl"
AZURE = TRACES / "azure_llm_2023_code_head.csv"


def _mooncake(tmp_path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    path = tmp_path / "t.jsonl"
    lines = [
        json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h})
        for t, i, o, h in rows
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------- parsers


def test_real_mooncake_window_scaled() -> None:
    got = tr.read_trace(MOONCAKE, tr.Scaling(limit=12, length_scale=0.125, time_scale=2))
    assert got.format == "mooncake" and len(got.requests) == 12
    first = got.requests[0]  # 6758 tokens in 14 blocks, 500 out (the file's first line)
    assert first.hash_ids == tuple(range(14)) and first.output_len == round(500 / 8)
    assert first.blocks == (64,) * 13 + (round((6758 - 13 * 512) / 8),)
    assert got.requests[10].arrival_s == pytest.approx(6.0)  # 3000 ms x 2
    later = tr.read_trace(MOONCAKE, tr.Scaling(limit=3, start_ms=3000))
    assert later.requests[0].arrival_s == 0.0 and later.requests[0].hash_ids[0] == 0


def test_real_azure_window() -> None:
    got = tr.read_trace(AZURE, tr.Scaling(limit=3))
    assert got.format == "azure"
    assert [(r.input_len, r.output_len, r.hash_ids) for r in got.requests] == [
        (4808, 10, ()), (3180, 8, ()), (110, 27, ())
    ]  # fmt: skip
    assert [r.arrival_s for r in got.requests] == pytest.approx([0.0, 0.052, 0.0981891], abs=1e-6)
    assert tr.expected_prefix_hits(got.requests)["prefix_hit_ratio"] == 0.0


def test_plain_csv_and_bad_files(tmp_path: Path) -> None:
    plain = tmp_path / "p.csv"
    plain.write_text("arrival_s,input_tokens,output_tokens\n10,5,2\n10.5,3,1\n")
    got = tr.read_trace(plain, tr.Scaling())
    assert got.format == "csv" and [r.arrival_s for r in got.requests] == [0.0, 0.5]
    bad = {
        "nocol.csv": ("arrival_s,input_tokens\n1,2\n", "no output column"),
        "back.csv": ("arrival_s,input_tokens,output_tokens\n2,1,1\n1,1,1\n", "back in time"),
        "word.csv": ("TIMESTAMP,ContextTokens,GeneratedTokens\nnow,1,1\n", "expected a time"),
        "x.jsonl": ('{"timestamp": 0}\n', "not a Mooncake trace line"),
        "ids.jsonl": ('{"timestamp":0,"input_length":600,"output_length":1,"hash_ids":[1]}\n',
                      "1 hash_ids for 600 tokens"),
    }  # fmt: skip
    for name, (text, message) in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message):
            tr.read_trace(tmp_path / name, tr.Scaling())
    with pytest.raises(ValueError, match="cannot read"):
        tr.read_trace(tmp_path / "missing.jsonl", tr.Scaling())
    for bad_scaling in ({"limit": 0}, {"length_scale": 0.0}, {"time_scale": float("inf")}):
        with pytest.raises(ValueError, match="must be"):
            tr.Scaling(**bad_scaling)  # type: ignore[arg-type]


def test_fit_cuts_the_tail_and_keeps_the_prefix() -> None:
    req = tr.TraceRequest(0.0, (64, 64, 30), (7, 8, 9), 100)
    assert tr.fit(req, 1000) is req
    cut = tr.fit(req, 150)  # output to 75 (half), prompt to 75 tokens: 64 + 11
    assert (cut.blocks, cut.hash_ids, cut.output_len, cut.truncated) == ((64, 11), (7, 8), 75, True)


def test_expected_prefix_hits_known_answer() -> None:
    reqs = [
        tr.TraceRequest(0.0, (4, 4, 2), (0, 1, 2), 1),
        tr.TraceRequest(0.0, (4, 4), (0, 3), 1),  # block 0 seen: 4 of 8
        tr.TraceRequest(0.0, (4, 4, 4), (0, 1, 2), 1),  # 0, 1 whole; 2 seen only 2 long: 10
    ]
    got = tr.expected_prefix_hits(reqs)
    assert got["prefix_hit_tokens"] == 14 and got["prompt_tokens"] == 30
    assert got["prefix_hit_ratio"] == pytest.approx(14 / 30)


# ---------------------------------------------------------------------------- block synthesis


def test_block_ids_repeat_exactly_where_hash_ids_do() -> None:
    a = tr.TraceRequest(0.0, (16, 16, 5), (0, 1, 2), 1)
    b = tr.TraceRequest(0.0, (16, 16), (0, 3), 1)
    pa, pb = tr.prompt_ids(a, 0, seed=0), tr.prompt_ids(b, 1, seed=0)
    assert len(pa) == 37 and len(pb) == 32
    assert pa[:16] == pb[:16] and pa[16:32] != pb[16:32]
    assert tr.prompt_ids(a, 0, seed=1)[:16] != pa[:16]  # the seed changes every block
    # no hashes (Azure): each request its own prompt, however equal the lengths
    c, d = (tr.TraceRequest(0.0, (16,), (), 1) for _ in range(2))
    assert tr.prompt_ids(c, 0, 0) != tr.prompt_ids(d, 1, 0)


def test_text_blocks_are_exact_token_blocks(default_tokenizer) -> None:  # type: ignore[no-untyped-def]
    bt = BlockText(default_tokenizer, seed=0)
    a = tr.TraceRequest(0.0, (64, 64, 13), (0, 1, 2), 1)
    b = tr.TraceRequest(0.0, (64, 64, 64), (0, 1, 5), 1)
    ta, tb = bt.prompt(a, 0), bt.prompt(b, 1)
    ids_a, ids_b = (default_tokenizer.encode(t, add_special_tokens=False) for t in (ta, tb))
    assert len(ids_a) == 141 and len(ids_b) == 192
    assert ids_a[:128] == ids_b[:128] and ids_a[128:] != ids_b[128:141]
    one, two = bt.check(64)
    assert bt.count(one) == 64 and bt.count(two) == 128


# ---------------------------------------------------------------------------- against a fake server


def _fake(seen: list[tuple[float, dict[str, Any]]]) -> FastAPI:
    """Streams max_tokens words; counts prompt tokens (words or ids) in /metrics, and computes
    every other one (so the server-side hit ratio is 0.5)."""
    app, sent = FastAPI(), {"n": 0}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "fake", "max_model_len": 120}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        n = sent["n"]
        return PlainTextResponse(
            f"# TYPE pdserve_prompt_tokens counter\npdserve_prompt_tokens_total {n}\n"
            "# TYPE pdserve_worker_prefill_tokens counter\n"
            f'pdserve_worker_prefill_tokens_total{{worker="w0",role="colocated"}} {n // 2}\n'
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        seen.append((time.perf_counter(), body))
        p = body["prompt"]
        n_prompt = len(p) if isinstance(p, list) else len(p.split())
        sent["n"] += n_prompt
        usage = {"prompt_tokens": n_prompt, "completion_tokens": body["max_tokens"]}
        if not body.get("stream"):
            return {"choices": [{"text": " x"}], "usage": usage}

        async def stream() -> AsyncIterator[str]:
            for _ in range(body["max_tokens"]):
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": " w"}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, list[tuple[float, dict[str, Any]]]]]:
    seen: list[tuple[float, dict[str, Any]]] = []
    with serving(_fake(seen)) as url:
        yield url, seen


def _args(trace: Path, url: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)
    return parser.parse_args([str(trace), "--url", url, "--no-progress", *extra])


def test_replay_sends_the_trace_on_time_and_reports_reuse(tmp_path, fake, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(replay, "SETTLE_S", 0.0)
    url, seen = fake
    rows = [(0, 1024, 40, [0, 1]), (300, 1100, 80, [0, 1, 2]), (600, 2000, 8, [5, 6, 7, 8])]
    trace = _mooncake(tmp_path, rows)
    seen.clear()
    args = _args(trace, url, "--length-scale", "0.0625", "--time-scale", "0.5",
                 "--prompt-format", "ids")  # fmt: skip
    res = asyncio.run(replay.run_replay(args))
    bodies = [b for _, b in seen]
    assert [b["max_tokens"] for b in bodies] == [2, 5, 1]  # 40, 80, 8 x 1/16 (>= 1)
    assert all(b["ignore_eos"] and b["stream"] for b in bodies)
    assert [len(b["prompt"]) for b in bodies] == [64, 69, 118]  # 32-token blocks; 125 cut
    assert bodies[0]["prompt"] == bodies[1]["prompt"][:64]
    gaps = [seen[i + 1][0] - seen[i][0] for i in range(2)]
    assert gaps == pytest.approx([0.15, 0.15], abs=0.08)  # 300 ms x 0.5
    assert res["completed"] == 3 and res["failed"] == 0
    assert res["prefix_hit_ratio"] == pytest.approx(64 / (64 + 69 + 118))
    assert res["server_prefix_hit_ratio"] == pytest.approx(0.5, abs=0.01)
    cfg = res["config"]
    assert (cfg["length_scale"], cfg["time_scale"], cfg["block_tokens"]) == (0.0625, 0.5, 32)
    assert cfg["truncated"] == 1 and cfg["max_model_len"] == 120
    for key in ("ttft_ms", "tpot_ms"):
        assert set(res[key]) == {"mean", "p50", "p90", "p99"}
    text = replay.format_replay(res)
    assert "lengths x 0.0625" in text and "arrival times x 0.5" in text


def test_replay_cli_text_prompts_checked_and_json(tmp_path, fake, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(replay, "SETTLE_S", 0.0)
    url, seen = fake
    trace = _mooncake(tmp_path, [(0, 600, 100, [0, 1]), (10, 600, 100, [0, 2])])
    out = tmp_path / "r.json"
    seen.clear()
    argv = ["bench", "replay", str(trace), "--url", url, "--length-scale", "0.03125",
            "--json", str(out), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    for key in ("completed", "failed", "prefix_hit_ratio", "ttft_ms", "tpot_ms"):
        assert key in res
    assert res["config"]["server_block_tokens"] == 16  # the fake counts words: one per token
    prompts = [b["prompt"] for _, b in seen if b.get("stream")]
    assert prompts[0][: len(prompts[0]) // 2] == prompts[1][: len(prompts[0]) // 2]
    assert "prefix hit ratio: trace 0.421" in capsys.readouterr().out  # 16 of 2 x (16 + 3)


def test_replay_bad_input_is_a_clear_error(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    trace = _mooncake(tmp_path, [(0, 10, 1, [0])])
    argv = ["bench", "replay", str(trace), "--url", "http://127.0.0.1:9", "--no-progress"]
    assert cli.main(argv) == 2
    assert "ConnectError" in capsys.readouterr().err
    assert cli.main(["bench", "replay", str(tmp_path / "none.jsonl"), "--url", "x"]) == 2
    assert "cannot read the trace" in capsys.readouterr().err


# ---------------------------------------------------------------------------- against pdserve


@pytest.mark.slow
def test_replay_against_pdserve_measures_the_trace_reuse(tmp_path, tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    """Text prompts on the tiny model (the default model's tokenizer): the server counts each
    block as its length, every output is exactly max_tokens, and the prefix cache's hits (from
    /metrics) are the trace's to within a token a request."""
    from test_serve import Server

    # turn i: the previous turn's whole blocks, one more, then a partial block of its own (as
    # Mooncake hashes: a partial block's id never matches a longer block's)
    rows = [(500 * i, 512 * (i + 2) - 100, 96, [*range(i + 1), 100 + i]) for i in range(4)]
    trace = _mooncake(tmp_path, rows)
    srv = Server(str(tiny_llama_path), "--colocated", "1")
    try:
        args = _args(trace, srv.url, "--length-scale", "0.03125")
        res = asyncio.run(replay.run_replay(args))
    finally:
        srv.stop()
    assert res["completed"] == 4 and res["failed"] == 0, res["errors"]
    assert res["config"]["server_block_tokens"] == 16
    assert all(r["output_tokens"] == r["max_tokens"] == 3 for r in res["requests"])
    assert [r["prompt_tokens"] for r in res["requests"]] == [16 * (i + 1) + 13 for i in range(4)]
    assert res["prefix_hit_ratio"] == pytest.approx(96 / 212)  # 16 x (0 + 1 + 2 + 3) hit
    assert res["server_prefix_hit_ratio"] == pytest.approx(res["prefix_hit_ratio"], abs=0.01)


def test_server_reuse_counts_only_admitted_prompts() -> None:
    """A refused request's prompt tokens reach the router's counter but no worker computes
    them: counted as sent they would read as prefix hits."""
    before = {"prompt_tokens": 100.0, "prefill_tokens": 50.0,
              "kv_pool_hit_blocks": 0.0, "kv_pool_lookup_blocks": 0.0}  # fmt: skip
    after = {"prompt_tokens": 1100.0, "prefill_tokens": 650.0,
             "kv_pool_hit_blocks": 0.0, "kv_pool_lookup_blocks": 0.0}  # fmt: skip
    # 1000 tokens sent, 400 of them refused: 600 admitted, all computed
    got = replay.server_reuse(before, after, refused_tokens=400)
    assert got["prefix_hit_ratio"] == 0.0
    assert got["prompt_tokens"] == 600 and got["refused_prompt_tokens"] == 400
    assert replay.server_reuse(before, after)["prefix_hit_ratio"] == pytest.approx(0.4)
    assert replay.server_reuse(None, after)["prefix_hit_ratio"] is None
