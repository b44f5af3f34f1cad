"""`pdserve sim --trace`: a production trace's arrivals, lengths and shared blocks through the
simulator (workloads/traces.py reads it, as `bench replay` does): the workers' prefix caches
find the blocks the trace repeats, prefix-aware routing finds more of them, and a trace without
hashes (Azure) shares nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve import cli


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert cli.main(["sim", "--hardware", "h100", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def _two_conversations(tmp_path: Path) -> Path:
    """Conversations A and B, each turn's prompt its previous one plus a block, in an order
    where round robin over two workers sends each turn away from its previous one."""
    order = [("A", 1), ("A", 2), ("B", 1), ("B", 2), ("A", 3), ("B", 3), ("A", 4), ("B", 4)]
    lines = []
    for i, (conv, turn) in enumerate(order):
        ids = [(0 if conv == "A" else 100) + b for b in range(turn + 1)]
        row = {"timestamp": 2000 * i, "input_length": 512 * len(ids) - 100,
               "output_length": 20, "hash_ids": ids}  # fmt: skip
        lines.append(json.dumps(row))
    path = tmp_path / "two.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prefix_cache_hits_follow_the_trace_and_prefix_routing(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    trace = str(_two_conversations(tmp_path))
    one = _run(capsys, "--trace", trace, "--colocated", "1")
    expected = one["trace"]["prefix_hit_ratio"]
    # turn k finds turn k-1's blocks, its last one only as long as it was there (412 tokens)
    hits = sum(512 * (n - 1) + 412 for n in (2, 3, 4))
    assert expected == pytest.approx(hits / sum(512 * n - 100 for n in (2, 3, 4, 5)))
    # one worker holds every block: it finds all the trace promises but a block's last token
    assert one["prefix_hit_ratio"] == pytest.approx(expected, abs=0.01)
    rr = _run(capsys, "--trace", trace, "--colocated", "2")
    routed = _run(capsys, "--trace", trace, "--colocated", "2", "--router", "planner",
                  "--prefix-routing")  # fmt: skip
    assert rr["prefix_hit_ratio"] < expected - 0.1
    assert routed["prefix_hit_ratio"] == pytest.approx(expected, abs=0.01)
    assert routed["ttft_s"]["p50"] < rr["ttft_s"]["p50"]


def test_window_scaling_and_an_azure_trace(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    trace = str(_two_conversations(tmp_path))
    got = _run(capsys, "--trace", trace, "--colocated", "1", "--start-ms", "4000", "--limit",
               "3", "--length-scale", "0.5", "--time-scale", "0.25")  # fmt: skip
    t = got["trace"]
    assert (t["requests"], t["block_tokens"], t["length_scale"], t["time_scale"]) == (
        3,
        256,
        0.5,
        0.25,
    )
    assert got["requests"] == 3 and got["duration_s"] < 4.0  # 3 arrivals 0.5 s apart
    azure = tmp_path / "a.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:17:03.9799600,600,4",
            "2023-11-16 18:17:04.0319600,600,4"]  # fmt: skip
    azure.write_text("\n".join(rows) + "\n")
    got = _run(capsys, "--trace", str(azure), "--colocated", "1")
    assert got["trace"]["format"] == "azure" and got["served"] == 2
    assert got["prefix_hit_ratio"] == 0.0 and got["trace"]["prefix_hit_ratio"] == 0.0


def test_bad_trace_flags_are_clear_errors(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    trace = str(_two_conversations(tmp_path))
    assert cli.main(["sim", "--trace", trace, "--start-ms", "1e9"]) == 2
    assert "no request at or after" in capsys.readouterr().err
    assert cli.main(["sim", "--trace", str(tmp_path / "none.csv")]) == 2
    assert "cannot read the trace" in capsys.readouterr().err


def test_validation_runs_the_traces_window_as_sim_does(tmp_path: Path) -> None:
    """`python -m pdserve.sim.validate --trace` (simulated vs real on this machine) runs the
    requests `pdserve sim --trace` simulates: same window, scaling, arrivals and blocks."""
    import argparse

    from pdserve.sim import validate
    from pdserve.sim.workload import trace_requests
    from pdserve.workloads.traces import Scaling, read_trace

    trace = _two_conversations(tmp_path)
    args = argparse.Namespace(
        trace=trace, limit=6, start_ms=2000.0, length_scale=0.5, time_scale=3.0, seed=1
    )
    got = validate.workload(args)
    want = trace_requests(read_trace(trace, Scaling(6, 2000.0, 0.5, 3.0)), 1)
    assert [(r.arrival, r.prompt, r.max_tokens) for r in got] == [
        (r.arrival, r.prompt, r.max_tokens) for r in want
    ]
    assert len(got) == 6 and got[1].arrival == pytest.approx(6.0)  # 2 s apart, x3
    assert got[0].prompt[:256] == got[3].prompt[:256]  # A's first block, shared across turns


def test_a_kv_pool_finds_what_round_robin_sends_away(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Round robin sends each turn away from the worker holding the previous one; with a KV
    pool (sim/pool.py) the other worker loads those blocks instead of recomputing them."""
    trace = str(_two_conversations(tmp_path))
    one = _run(capsys, "--trace", trace, "--colocated", "1")
    expected = one["trace"]["prefix_hit_ratio"]
    rr = _run(capsys, "--trace", trace, "--colocated", "2")
    pooled = _run(capsys, "--trace", trace, "--colocated", "2", "--kv-pool")
    assert rr["prefix_hit_ratio"] < expected - 0.1 and "kv_pool" not in rr
    assert pooled["prefix_hit_ratio"] == pytest.approx(expected, abs=0.01)
    # every hit round robin missed came from the pool, and cost less than computing it
    assert pooled["kv_pool_hit_ratio"] == pytest.approx(expected - rr["prefix_hit_ratio"], abs=0.01)
    assert pooled["kv_pool"]["hit_tokens"] > 0 and pooled["kv_pool"]["evicted_blocks"] == 0
    assert pooled["ttft_s"]["p50"] < rr["ttft_s"]["p50"]
    # a pool of a few blocks keeps only the newest: fewer hits, evictions counted
    small = _run(capsys, "--trace", trace, "--colocated", "2", "--kv-pool", "--kv-pool-gb",
                 "0.0003")  # fmt: skip
    assert small["kv_pool"]["evicted_blocks"] > 0
    assert small["kv_pool_hit_ratio"] < pooled["kv_pool_hit_ratio"]


def test_kv_pool_sizes_need_the_pool(capsys) -> None:  # type: ignore[no-untyped-def]
    code = cli.main(["sim", "--hardware", "h100", "--colocated", "1", "--kv-pool-gb", "1"])
    assert code == 2 and "need --kv-pool" in capsys.readouterr().err


def test_a_prompt_past_the_models_context_is_refused_as_the_engine_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine refuses a prompt of max_model_len tokens or more before any work; the
    simulator did not, and spent a long prefill on it while others queued behind."""
    import shutil

    from pdserve.sim.hardware import CONFIG_DIR

    cfg = json.loads((CONFIG_DIR / "llama-3.1-8b.json").read_text())
    model = tmp_path / "config.json"
    model.write_text(json.dumps({**cfg, "max_position_embeddings": 1500}))
    trace = _two_conversations(tmp_path)  # prompts of 924, 1436, 1948 and 2460 tokens
    got = _run(capsys, "--trace", str(trace), "--colocated", "1", "--model", str(model))
    assert got["rejected"] == 4 and got["served"] == 4
    assert got["counters"]["rejected_invalid_request"] == 4
    shutil.copy(CONFIG_DIR / "llama-3.1-8b.json", model)  # 131072 positions: all served
    assert (
        _run(capsys, "--trace", str(trace), "--colocated", "1", "--model", str(model))["rejected"]
        == 0
    )
