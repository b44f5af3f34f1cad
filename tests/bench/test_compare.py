"""`pdserve bench compare`: the timeline breakdown and SLO arithmetic on known inputs, the report
from a hand-made result, and one end-to-end run against real `pdserve serve` processes (tiny
model, both pdserve forms, the rag workload)."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench import compare, compare_report
from pdserve.bench.compare_report import breakdown


def _tl(*events: tuple[str, float]) -> list[dict[str, Any]]:
    return [{"event": e, "worker": "w", "t_ms": t} for e, t in events]


def test_breakdown_colocated() -> None:
    events = _tl(("arrive", 0), ("dispatch", 1), ("queue", 2), ("prefill_start", 30),
                 ("prefill_end", 130), ("first_token", 131), ("finish", 1130))  # fmt: skip
    assert breakdown(events) == {"queue": 30, "prefill": 100, "transfer": 0, "decode": 1000}


def test_breakdown_disaggregated_counts_only_exposed_transfer() -> None:
    exposed = _tl(("arrive", 0), ("dispatch", 1), ("prefill_start", 10), ("transfer_start", 20),
                  ("prefill_end", 110), ("transfer_end", 125), ("decode_first_token", 160),
                  ("finish", 625))  # fmt: skip
    assert breakdown(exposed) == {"queue": 10, "prefill": 100, "transfer": 15, "decode": 500}
    hidden = _tl(("arrive", 0), ("prefill_start", 10), ("transfer_end", 100),
                 ("prefill_end", 110), ("finish", 610))  # fmt: skip
    assert breakdown(hidden) == {"queue": 10, "prefill": 100, "transfer": 0, "decode": 500}


def test_breakdown_retry_uses_last_attempt_and_incomplete_is_none() -> None:
    retried = _tl(("arrive", 0), ("dispatch", 1), ("prefill_start", 5), ("prefill_end", 50),
                  ("failed: link down", 60), ("dispatch", 61), ("prefill_start", 70),
                  ("prefill_end", 120), ("transfer_end", 130), ("finish", 330))  # fmt: skip
    assert breakdown(retried) == {"queue": 70, "prefill": 50, "transfer": 10, "decode": 200}
    assert breakdown(_tl(("arrive", 0), ("prefill_start", 5), ("aborted", 9))) is None
    assert breakdown([]) is None


def _phase(rate: float, ttfts: list[float], tpots: list[float], duration: float) -> dict[str, Any]:
    reqs = [
        {"ttft_ms": a, "tpot_ms": b, "error": None, "response_id": f"r{i}",
         "timeline": _tl(("arrive", 0), ("prefill_start", 10), ("prefill_end", a),
                         ("finish", a + 100 * b))}
        for i, (a, b) in enumerate(zip(ttfts, tpots, strict=True))
    ]  # fmt: skip
    stats = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    return {
        "phase": f"rate {rate:g}", "config": {"rate": rate, "num_requests": len(reqs)},
        "requests": reqs, "duration_s": duration, "completed": len(reqs), "failed": 0,
        "goodput": 0.0, "good_fraction": 0.0, "good": 0, "output_throughput": 1.0,
        "ttft_ms": stats, "tpot_ms": stats, "itl_ms": stats, "e2e_ms": stats,
    }  # fmt: skip


def test_apply_slos_recomputes_goodput() -> None:
    res = _phase(1.0, [100, 200, 300, 400], [10, 20, 10, 10], duration=2.0)
    res["requests"].append({"ttft_ms": None, "tpot_ms": None, "error": "HTTP 429"})
    compare.apply_slos(res, slo_ttft=0.3, slo_tpot=0.015)
    assert res["good"] == 2 and res["goodput"] == 1.0  # requests 0 and 2
    assert res["good_fraction"] == pytest.approx(2 / 5)
    assert res["config"]["slo_ttft_s"] == 0.3 and res["config"]["slo_tpot_s"] == 0.015


def _result() -> dict[str, Any]:
    colo = {
        "name": "pdserve-colocated",
        "unloaded": _phase(0, [100, 120, 140], [10, 11, 12], 1),
        "rates": [_phase(0.5, [150, 900], [12, 30], 4), _phase(1, [200, 2000], [40, 50], 4)],
    }
    disagg = {
        "name": "pdserve-1p1d",
        "unloaded": _phase(0, [150, 150], [12, 12], 1),
        "rates": [_phase(0.5, [180, 200], [13, 14], 4), _phase(1, [250, 300], [14, 15], 4)],
    }
    peer = {
        "name": "transformers",
        "unloaded": _phase(0, [400], [30], 1),
        "rates": [_phase(0.5, [500, 600], [30, 30], 4), _phase(1, [900, 800], [30, 30], 4)],
    }
    skipped = {
        "name": "llama-cpp",
        "skipped": "llama_cpp is not installed (run `make bench-peers`)",
    }
    return {
        "command": "pdserve bench compare --rates 0.5,1", "started": "now", "wall_s": 60.0,
        "machine": {"cpu": "test cpu", "cores": 2, "python": "3.11"}, "cores": 2,
        "workload": {"workload": "rag", "input_len": 1000, "output_len": 128, "len_spread": 0.0,
                     "seed": 0, "num_requests": 2},
        "rates": [0.5, 1.0], "slo": {"ttft_s": 0.0, "tpot_s": 0.0, "how": ""},
        "systems": [colo, disagg, peer, skipped],
    }  # fmt: skip


def test_derived_slos_and_report(tmp_path: Path) -> None:
    result = _result()
    args = argparse.Namespace(slo_ttft=None, slo_tpot=None, slo_reference="pdserve-colocated",
                              slo_ttft_factor=3.0, slo_tpot_factor=1.5,
                              systems=[s["name"] for s in result["systems"]])  # fmt: skip
    ttft, tpot, how = compare.derive_slos(args, result["systems"])
    assert ttft == pytest.approx(0.36) and tpot == pytest.approx(0.0165)  # 3 x 120, 1.5 x 11
    assert "pdserve-colocated" in how
    # two references: the slower per metric (1p1d's TTFT 150, colocated's TPOT 11 vs 12 -> 12)
    args.slo_reference = "pdserve-colocated,pdserve-1p1d"
    both = compare.derive_slos(args, result["systems"])
    assert both[0] == pytest.approx(0.45) and both[1] == pytest.approx(0.018)
    result["slo"] = {"ttft_s": ttft, "tpot_s": tpot, "how": how}
    for s in result["systems"]:
        for res in s.get("rates", []):
            compare.apply_slos(res, ttft, tpot)
    # colocated: 1 good at 0.5 (0.25 req/s), 0 at 1; 1p1d: 2 and 2 (0.5); peer: none
    text = compare_report.write_report(result, tmp_path)
    assert "best goodput, 1P1D / colocated: **2.00x**" in text
    assert "1P1D / best peer: **inf (denominator 0)**" in text
    assert "llama-cpp: not measured: llama_cpp is not installed" in text
    assert "| pdserve-1p1d | 1 | 2 | 0 | 0.500 | 100% |" in text
    for name in ("attainment.png", "latency.png", "breakdown.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name
    assert (tmp_path / "report.md").read_text() == text
    # a saved results.json re-makes the same report
    (tmp_path / "results.json").write_text(json.dumps(result))
    assert compare_report.rebuild(tmp_path / "results.json") == text


def test_given_slos_win_and_missing_reference_is_an_error() -> None:
    systems = copy.deepcopy(_result()["systems"])
    args = argparse.Namespace(slo_ttft=2.0, slo_tpot=0.1, slo_reference="nope",
                              slo_ttft_factor=3.0, slo_tpot_factor=1.5,
                              systems=[s["name"] for s in systems])  # fmt: skip
    assert compare.derive_slos(args, systems)[:2] == (2.0, 0.1)
    args.slo_tpot = None
    with pytest.raises(ValueError, match="nope"):
        compare.derive_slos(args, systems)


def test_the_adaptive_system_shares_the_cores_and_schedules_for_the_given_slos() -> None:
    args = argparse.Namespace(model=None, cores=4, slo_ttft=2.0, slo_tpot=0.025, pdserve_args="")
    cmd = compare.SYSTEMS["pdserve-adaptive"].command(args, 8123)
    assert cmd[1:5] == ["serve", "--adaptive", "--cores", "4"]
    assert "--slo-ttft=2.0" in cmd and "--slo-tpot=0.025" in cmd
    args.slo_ttft = args.slo_tpot = None  # derived SLOs: the server keeps its defaults
    assert not any(
        a.startswith("--slo") for a in compare.SYSTEMS["pdserve-adaptive"].command(args, 1)
    )


def test_flags_are_checked() -> None:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    base = ["--num-requests", "2", "--output-dir", "x"]
    assert parser.parse_args(["--rates", "0.5,1", *base]).rates == [0.5, 1.0]
    for bad in (["--rates", "0,1"], ["--rates", "a"], ["--rates", "1", "--systems", "vllm"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*bad, *base])


def test_compare_end_to_end_on_tiny_model(tiny_llama_path: Path, tmp_path: Path) -> None:
    from pdserve.cli import main

    out = tmp_path / "cmp"
    argv = [
        "bench", "compare", "--systems", "pdserve-colocated,pdserve-1p1d", "--workload", "rag",
        "--rates", "8", "--num-requests", "4", "--unloaded-requests", "1", "--input-len", "150",
        "--output-len", "6", "--model", str(tiny_llama_path), "--output-dir", str(out),
        "--startup-timeout", "120", "--timeout", "60", "--slo-ttft", "60", "--slo-tpot", "10",
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["command"].startswith("pdserve bench compare --systems")
    # loose SLOs given (a loaded CI machine is slow): every completed request is good
    assert result["slo"] == {"ttft_s": 60, "tpot_s": 10, "how": "given on the command line"}
    names = [s["name"] for s in result["systems"]]
    assert names == ["pdserve-colocated", "pdserve-1p1d"]
    for s in result["systems"]:
        assert "failed" not in s, s.get("failed")
        (res,) = s["rates"]
        assert res["completed"] == 4 and res["failed"] == 0 and res["good"] == 4
        for key in ("duration_s", "request_throughput", "output_throughput", "goodput"):
            assert res[key] > 0, key
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(res[key]) == {"mean", "p50", "p90", "p99"}
        for r in res["requests"]:
            assert r["output_tokens"] == 6
            assert 140 <= r["prompt_tokens"] <= 150  # rag prompts filled to the target
            spans = breakdown(r["timeline"])
            assert spans is not None and all(v >= 0 for v in spans.values())
            # the spans cover arrival -> finish: close to the client's end-to-end time
            assert sum(spans.values()) <= r["e2e_ms"] + 50
        assert res["config"]["backend"] == "pdserve"
    disagg = result["systems"][1]["rates"][0]["requests"]
    assert any(e["event"] == "transfer_end" for r in disagg for e in r["timeline"])
    text = (out / "report.md").read_text()
    assert "| pdserve-1p1d | 8 | 4 | 0 |" in text
    assert (out / "breakdown.png").stat().st_size > 5000
    assert (out / "logs" / "pdserve-1p1d.log").is_file()
