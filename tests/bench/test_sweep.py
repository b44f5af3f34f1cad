"""`pdserve bench sweep`: the knee on known curves, the point order, the report from a hand-made
result, and a whole sweep against a fake OpenAI server (no model) with a system skipped."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from factories import serving
from pdserve.bench import compare, sweep, sweep_report
from pdserve.bench.sweep_report import Knee, knee
from pdserve.costmodel.model import CostModel
from pdserve.workloads.spec import arrival_gaps

FAKE_COST = CostModel((0.01, 0.001, 0.0), (0.005, 0.001, 0.0))  # the fake server's steps' prices


def test_knee_interpolates_between_the_bracketing_points() -> None:
    # 0.9 lies 1/3 of the way from 0.95 (rate 0.4) down to 0.8 (rate 0.6)... in reverse order
    curve = [(0.6, 0.8), (0.2, 1.0), (0.4, 0.95), (0.8, 0.1)]
    k = knee(curve, 0.9)
    assert k.kind == "interpolated" and k.rate == pytest.approx(0.4 + 0.2 * (0.05 / 0.15))


def test_knee_takes_the_first_fall_and_a_point_exactly_at_the_threshold_meets_it() -> None:
    assert knee([(1, 1.0), (2, 0.9), (3, 0.5), (4, 0.95)], 0.9) == Knee(
        pytest.approx(2 + 0.0 / 0.4), "interpolated", 0.9
    )


def test_knee_when_no_point_or_every_point_meets_the_threshold() -> None:
    assert knee([(0.1, 0.5), (0.2, 0.2)], 0.9) == Knee(None, "below_all", 0.9)
    assert knee([(0.1, 1.0), (0.3, 0.92)], 0.9) == Knee(0.3, "at_least", 0.9)
    with pytest.raises(ValueError):
        knee([], 0.9)
    with pytest.raises(ValueError):
        knee([(1, 1.0)], 0.0)


def test_knee_error_only_between_located_knees() -> None:
    assert sweep_report.knee_error(Knee(1.1, "interpolated", 0.9), Knee(1.0, "interpolated", 0.9)
                                   ) == pytest.approx(0.1)  # fmt: skip
    assert sweep_report.knee_error(Knee(1.0, "at_least", 0.9), Knee(1, "interpolated", 0.9)) is None


def test_interleaved_order_rotates_systems_and_random_is_a_seeded_permutation() -> None:
    order = sweep.plan(["a", "b", "c"], [0.1, 0.2], 2, "interleaved", seed=0)
    firsts = [order[i][2] for i in range(0, len(order), 3)]
    assert firsts == ["a", "b", "c", "a"]  # per (repeat, rate): a different system first
    assert order[:3] == [(0, 0.1, "a"), (0, 0.1, "b"), (0, 0.1, "c")]
    shuffled = sweep.plan(["a", "b", "c"], [0.1, 0.2], 2, "random", seed=3)
    assert sorted(shuffled) == sorted(order) and shuffled != order
    assert shuffled == sweep.plan(["a", "b", "c"], [0.1, 0.2], 2, "random", seed=3)


def _run(att: float, good: float, rep: int = 0) -> dict[str, Any]:
    lat = {"p50": 10.0, "p90": 20.0, "p99": 30.0}
    return {"rate": 0.0, "repeat": rep, "completed": 4, "failed": 0, "good": 4,
            "goodput": good, "duration_s": 10.0, "attainment": att,
            "ttft_ms": lat, "tpot_ms": lat}  # fmt: skip


def test_report_spread_knees_and_plot(tmp_path: Path) -> None:
    def point(rate: float, runs: list[dict[str, Any]]) -> dict[str, Any]:
        return sweep.point_json("pdserve-colocated", rate, ["pdserve", "serve"], runs, "cmd")

    measured = [point(0.2, [_run(1.0, 0.2), _run(0.9, 0.18, 1), _run(1.0, 0.2, 2)]),
                point(0.4, [_run(0.5, 0.2), _run(0.7, 0.3, 1), _run(0.6, 0.25, 2)])]  # fmt: skip
    assert measured[1]["spread"]["attainment"] == {"median": 0.6, "min": 0.5, "max": 0.7}
    assert measured[1]["attainment"] == 0.6  # the median run's numbers on top
    sim = {"points": [{"rate": 0.2, "attainment": 1.0, "goodput": 0.2},
                      {"rate": 0.4, "attainment": 0.8, "goodput": 0.3}],
           "levelled": [{"rate": 0.2, "attainment": 1.0, "goodput": 0.2, "prefill_x": 1.2,
                         "decode_x": 1.1},
                        {"rate": 0.4, "attainment": 0.5, "goodput": 0.2, "prefill_x": 1.5,
                         "decode_x": 1.25}]}  # fmt: skip
    result = {
        "command": "pdserve bench sweep", "started": "now", "order": "interleaved",
        "repeats": 3, "knee_attainment": 0.9, "workload": {"workload": "rag"},
        "machine": {"cpu": "test", "cores": 2, "load_average": [1.0, 1.0, 1.0]},
        "slo": {"ttft_s": 6.0, "tpot_s": 0.1},
        "systems": [{"name": "pdserve-colocated", "points": measured, "sim": sim},
                    {"name": "vllm-cpu", "skipped": "absent"}],
    }  # fmt: skip
    text = sweep_report.write(result, tmp_path)
    k = result["summary"]["pdserve-colocated"]
    # measured: 1.0 at 0.2 -> 0.6 at 0.4: 0.2 + 0.2 x 0.1/0.4; simulated: 0.2 + 0.2 x 0.1/0.2
    assert k["knee"]["rate"] == pytest.approx(0.25)
    assert k["sim_knee"]["rate"] == pytest.approx(0.3)
    assert k["sim_knee_error"] == pytest.approx(0.2)
    # at the probed level: 0.2 + 0.2 x 0.1/0.5 = 0.24, -4%
    assert k["levelled_knee"]["rate"] == pytest.approx(0.24)
    assert k["levelled_knee_error"] == pytest.approx(-0.04)
    assert "| pdserve-colocated | 0.25 req/s | 0.3 req/s | +20% | 0.24 req/s | -4% |" in text
    assert "80% / 50% (x1.50/x1.25)" in text
    assert "| vllm-cpu | skipped: absent |" in text
    assert "60% (50%-70%)" in text
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")
    assert json.loads((tmp_path / "summary.json").read_text())["summary"] == result["summary"]


def test_refusals_are_counted_apart_and_reported(tmp_path: Path) -> None:
    lat = {"p50": 10.0, "p90": 20.0, "p99": 30.0}
    res = {"completed": 3, "failed": 0, "good": 2, "goodput": 0.1, "duration_s": 20.0,
           "rejected": 1, "good_fraction": 0.5, "ttft_ms": lat, "tpot_ms": lat}  # fmt: skip
    stats = sweep.point_stats(res, 0.2, 0)
    assert stats["refused"] == 1 and stats["completed"] == 3 and stats["failed"] == 0
    older = sweep.point_stats({**res, "rejected": None}, 0.2, 0)  # a load result without one
    assert older["refused"] == 0
    point = sweep.point_json("pdserve-adaptive", 0.2, ["pdserve", "serve"], [stats], "cmd")
    result = {
        "command": "pdserve bench sweep", "started": "now", "order": "interleaved",
        "repeats": 1, "knee_attainment": 0.9, "workload": {"workload": "rag"},
        "machine": {"cpu": "test", "cores": 2, "load_average": [1.0, 1.0, 1.0]},
        "slo": {"ttft_s": 10.0, "tpot_s": 0.1},
        "systems": [{"name": "pdserve-adaptive", "points": [point]}],
    }  # fmt: skip
    text = sweep_report.write(result, tmp_path)
    assert "| completed | refused | failed | runs |" in text
    assert "| 3 | 1 | 0 | 1 |" in text


# ---------------------------------------------------------------------------- a whole sweep


def _fake_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        n = int((await request.json())["max_tokens"])

        async def stream() -> AsyncIterator[str]:
            for i in range(n):
                await asyncio.sleep(0.001)
                choice = {"index": 0, "text": f" t{i}", "finish_reason": None}
                yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
            usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/admin/steps")
    async def steps(since: float) -> dict[str, Any]:
        """P's six lone prefill steps at 2x FAKE_COST's price, then D's six decodes at 3x."""
        from pdserve.sim.steptime import CostModelStep

        priced = CostModelStep(FAKE_COST).priced
        p = [[since + i, 2 * priced(0, 0, [(8, 0)]), 0, 0, 8, 0] for i in range(6)]
        d = [[since + 10 + i, 3 * priced(2, 20, []), 2, 20] for i in range(6)]
        return {"since": since, "workers": {"P0": p, "D0": d}, "missing": []}

    return app


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with serving(_fake_app()) as url:
        yield url


def test_sweep_against_a_fake_server(
    fake_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []

    @contextlib.contextmanager
    def fake_server(system: Any, args: Any, log: Path) -> Iterator[str]:
        started.append(system.name)
        yield fake_url

    monkeypatch.setattr(compare, "running_server", fake_server)
    from pdserve.cli import main

    out = tmp_path / "sweep"
    argv = [
        "bench", "sweep", "--systems", "pdserve-colocated,pdserve-1p1d,vllm-cpu",
        "--vllm-python", str(tmp_path / "absent"), "--workload", "synthetic",
        "--input-len", "8", "--output-len", "3", "--rates", "40,80", "--num-requests", "3",
        "--slo-ttft", "30", "--slo-tpot", "5", "--output-dir", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    # a fresh server per point, interleaved: 2 systems x 2 rates, the second rate 1p1d first
    assert started == ["pdserve-colocated", "pdserve-1p1d", "pdserve-1p1d", "pdserve-colocated"]
    point = json.loads((out / "pdserve-1p1d" / "rate-80.json").read_text())
    assert point["rate"] == 80 and point["completed"] == 3 and point["failed"] == 0
    assert point["refused"] == 0
    assert point["attainment"] == 1.0 and point["goodput"] > 0  # loose SLOs: every one good
    assert set(point["ttft_ms"]) == set(point["tpot_ms"]) == {"p50", "p90", "p99"}
    assert "--prefill 1 --decode 1" in point["command"]
    assert point["sweep_command"].startswith("pdserve bench sweep")
    assert [r["repeat"] for r in point["runs"]] == [0]
    requests = out / "pdserve-1p1d" / "requests" / "rate-80-run1.json"
    assert len(json.loads(requests.read_text())) == 3
    summary = json.loads((out / "summary.json").read_text())["summary"]
    assert summary["vllm-cpu"]["skipped"].endswith("(run `make bench-peers`)")
    every_point_met = {"rate": 80, "kind": "at_least", "threshold": 0.9}
    assert summary["pdserve-colocated"]["knee"] == every_point_met
    assert (out / "sweep.png").is_file() and "## Knees" in (out / "report.md").read_text()

    # predicted afterwards (bench sweep-sim): sim points beside the measured ones, which stay
    from pdserve.costmodel.model import CostModel

    cm = tmp_path / "cm.json"
    CostModel((0.01, 0.001, 0.0), (0.005, 0.001, 0.0)).save(cm, kv_bytes_per_token=100_000)
    measured = json.loads((out / "summary.json").read_text())
    assert main(["bench", "sweep-sim", str(out), "--cost-model", str(cm)]) == 0
    again = json.loads((out / "summary.json").read_text())
    for before, after in zip(measured["systems"], again["systems"], strict=True):
        assert before.get("points") == after.get("points")
    sim = {s["name"]: s["sim"] for s in again["systems"]}
    assert [p["rate"] for p in sim["pdserve-1p1d"]["points"]] == [40, 80]
    assert sim["pdserve-colocated"]["cost_model"] == str(cm)
    assert "peer" in sim["vllm-cpu"]["skipped"]
    assert "simulated again on" in (out / "report.md").read_text()
    assert main(["bench", "sweep-sim", str(tmp_path / "nothing")]) == 2


def test_sweep_needs_slos_and_distinct_rates() -> None:
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--rates", "1", "--num-requests", "2", "--output-dir", "x"])
    args = parser.parse_args(["--rates", "1,1", "--num-requests", "2", "--output-dir", "x",
                              "--slo-ttft", "1", "--slo-tpot", "1"])  # fmt: skip
    with pytest.raises(ValueError, match="twice"):
        sweep.check(args)


def _sim_args(tmp_path: Path, systems: str) -> argparse.Namespace:
    """A sweep of 300-token prompts at 0.1 and 50 req/s over a hand-made cost model."""
    from pdserve.costmodel.model import CostModel

    path = tmp_path / "cm.json"
    # 100 kB a token: 1 GiB of KV holds ~10k tokens, few blocks to build
    CostModel((0.1, 0.002, 0.0), (0.05, 0.001, 0.0)).save(path, kv_bytes_per_token=100_000)
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    return parser.parse_args([
        "--systems", systems, "--rates", "0.1,50", "--num-requests", "6", "--input-len", "300",
        "--output-len", "4", "--slo-ttft", "1", "--slo-tpot", "1", "--cores", "2",
        "--cost-model", str(path), "--output-dir", str(tmp_path),
        "--seed", "3",  # at 0.1 req/s its gaps are >= 2.6 s
    ])  # fmt: skip


def test_sim_predicts_the_sweep_of_the_pdserve_systems(tmp_path: Path) -> None:
    from pdserve.bench import sweep_sim

    args = _sim_args(tmp_path, "pdserve-colocated,pdserve-1p1d,pdserve-adaptive,vllm-cpu")
    colocated = sweep_sim.predict("pdserve-colocated", args)
    assert colocated["deployment"] == "1 colocated x TP1"
    assert "--colocated 1 --threads 2" in colocated["command"]
    disagg = sweep_sim.predict("pdserve-1p1d", args)
    assert disagg["deployment"] == "1P(TP1) : 1D(TP1)"
    for pred in (colocated, disagg):
        slow, fast = pred["points"]
        assert (slow["rate"], fast["rate"]) == (0.1, 50)
        # alone a 300-token prompt takes ~0.6 s (58 cached); six at once queue past 1 s
        assert slow["attainment"] == 1.0 and fast["attainment"] < 1.0
        assert fast["ttft_ms"]["p90"] > 1000
    adaptive = sweep_sim.predict("pdserve-adaptive", args)
    assert adaptive["deployment"] == "1P(TP1) : 1D(TP1)" and len(adaptive["points"]) == 2
    assert "peer" in sweep_sim.predict("vllm-cpu", args)["skipped"]
    # the predicted point's requests arrive when bench serve sends the measured point's
    sent = list(itertools.accumulate(arrival_gaps(50.0, 1.0, 6, args.seed)))
    assert [r.arrival for r in sweep_sim.workload(args, 50.0)] == pytest.approx(
        [t - sent[0] for t in sent]
    )


def test_levels_are_the_median_of_each_rates_probes() -> None:
    from pdserve.bench import sweep_sim

    def run(px: float, dx: float) -> dict[str, Any]:
        return {**_run(1.0, 0.1), "level": {"prefill_x": px, "decode_x": dx}}

    system = {"points": [
        {"rate": 0.2, "runs": [run(1.0, 2.0), run(3.0, 1.0), run(2.0, 9.0)]},
        {"rate": 0.4, "runs": [{**_run(1.0, 0.1), "level": {"error": "probe failed"}}]},
        {"rate": 0.6, "runs": [], "failed": "not run"},
    ]}  # fmt: skip
    assert sweep_sim.levels(system) == {0.2: (2.0, 2.0)}
    assert sweep_sim.levels({"name": "vllm-cpu", "skipped": "absent"}) == {}


def test_a_runs_own_steps_level_falls_back_to_the_probe_per_kind() -> None:
    from pdserve.bench import sweep_sim

    probe = {"prefill_x": 2.0, "decode_x": 1.5}
    both = {"prefill_x": 1.2, "decode_x": 1.1, "fallback": []}
    few_prefills = {"prefill_x": 1.0, "decode_x": 1.1, "fallback": ["prefill"]}
    assert sweep_sim.run_factors({"level": probe, "steps_level": both}, "steps") == (1.2, 1.1)
    assert sweep_sim.run_factors({"level": probe, "steps_level": few_prefills}, "steps") == (
        2.0, 1.1)  # fmt: skip
    assert sweep_sim.run_factors({"level": probe, "steps_level": {"error": "404"}}, "steps") is None
    assert sweep_sim.run_factors({"level": {"error": "x"}, "steps_level": few_prefills},
                                 "steps") is None  # fmt: skip
    assert sweep_sim.run_factors({"steps_level": both}, "steps") == (1.2, 1.1)
    assert sweep_sim.run_factors({"level": probe, "steps_level": both}, "probe") == (2.0, 1.5)
    points = {
        "points": [
            {
                "rate": 0.2,
                "runs": [
                    {"level": probe, "steps_level": both},
                    {"level": probe, "steps_level": few_prefills},
                ],
            }
        ]
    }
    assert sweep_sim.levels(points, "steps") == {0.2: (pytest.approx(1.6), pytest.approx(1.1))}


def test_steps_level_prices_the_servers_steps_with_the_systems_cost_model(tmp_path: Path) -> None:
    from pdserve.bench import sweep_sim
    from pdserve.sim.steptime import CostModelStep

    args = _sim_args(tmp_path, "pdserve-1p1d")
    model = CostModel.load(args.cost_model)
    price = CostModelStep(model).priced(0, 0, [(300, 0)])
    logs = {"workers": {"P0": [[float(i), 1.5 * price, 0, 0, 300, 0] for i in range(5)],
                        "D0": [[10.0, 0.01, 1, 5]]}, "missing": ["D1"]}  # fmt: skip
    got = sweep_sim.steps_level("pdserve-1p1d", args, logs)
    assert got["prefill_x"] == pytest.approx(1.5) and got["fallback"] == ["decode"]
    assert got["missing"] == ["D1"] and got["lone_steps"] == 6
    assert sweep_sim.steps_level("pdserve-1p1d", args, {"error": "404"}) == {"error": "404"}
    assert "error" in sweep_sim.steps_level("pdserve-1p1d", args, {"workers": {"P0": [[1.0]]}})


def test_host_level_probes_the_systems_cost_model_and_a_failure_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.bench import sweep_sim
    from pdserve.costmodel import host_level

    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    args = parser.parse_args(["--rates", "1", "--num-requests", "2", "--slo-ttft", "1",
                              "--slo-tpot", "1", "--cores", "2", "--output-dir", str(tmp_path),
                              "--cost-model", str(tmp_path / "cm.json"),
                              "--pdserve-args=--prefill-format bf16"])  # fmt: skip
    asked: list[tuple[Any, ...]] = []

    def measure(path: Path, model: Any, threads: int, settings: dict[str, str]) -> Any:
        asked.append((path, threads, settings["prefill_format"]))
        if threads == 2:
            raise RuntimeError("host level probe failed (1): boom")
        return host_level.Level(1.5, 1.25, 0.3, 0.02, 4140, 9.0)

    monkeypatch.setattr(host_level, "measure", measure)
    assert sweep_sim.host_level("pdserve-1p1d", args) == {
        "prefill_x": 1.5, "decode_x": 1.25, "prefill_s": 0.3, "decode_s": 0.02,
        "decode_context": 4140, "seconds": 9.0,
    }  # fmt: skip
    assert asked == [(tmp_path / "cm.json", 1, "bf16")]  # 1 + 1 threads on 2 cores
    assert "boom" in sweep_sim.host_level("pdserve-colocated", args)["error"]
    assert sweep_sim.host_level("vllm-cpu", args) is None


def test_sim_at_the_probed_level(tmp_path: Path) -> None:
    from pdserve.bench import sweep_sim

    args = _sim_args(tmp_path, "pdserve-1p1d")
    pred = sweep_sim.predict("pdserve-1p1d", args, {0.1: (1.0, 1.0), 50: (3.0, 3.0)})
    same, slow = pred["levelled"]
    assert {k: v for k, v in same.items() if not k.endswith("_x")} == pred["points"][0]
    assert (slow["prefill_x"], slow["decode_x"]) == (3.0, 3.0)
    # three times slower steps: every queued prompt's TTFT is longer
    assert slow["ttft_ms"]["p50"] > 2 * pred["points"][1]["ttft_ms"]["p50"]
    assert "levelled" not in sweep_sim.predict("pdserve-1p1d", args, {7.0: (2.0, 2.0)})


def test_sweep_with_sim_probes_the_host_before_each_pdserve_point(
    fake_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.bench import sweep_sim
    from pdserve.cli import main

    @contextlib.contextmanager
    def fake_server(system: Any, args: Any, log: Path) -> Iterator[str]:
        yield fake_url

    probed: list[str] = []

    def probe(name: str, args: Any) -> dict[str, Any] | None:
        probed.append(name)
        return None if name == "vllm-cpu" else {"prefill_x": 2.0, "decode_x": 1.5}

    monkeypatch.setattr(compare, "running_server", fake_server)
    monkeypatch.setattr(sweep_sim, "host_level", probe)
    cm = tmp_path / "cm.json"
    FAKE_COST.save(cm, kv_bytes_per_token=100_000)
    out = tmp_path / "sweep"
    argv = [
        "bench", "sweep", "--systems", "pdserve-1p1d", "--workload", "synthetic",
        "--input-len", "8", "--output-len", "3", "--rates", "40", "--num-requests", "3",
        "--slo-ttft", "30", "--slo-tpot", "5", "--output-dir", str(out), "--sim",
        "--cost-model", str(cm),
    ]  # fmt: skip
    assert main(argv) == 0 and probed == ["pdserve-1p1d"]
    point = json.loads((out / "pdserve-1p1d" / "rate-40.json").read_text())
    assert point["runs"][0]["level"] == {"prefill_x": 2.0, "decode_x": 1.5}
    result = json.loads((out / "summary.json").read_text())
    (levelled,) = result["systems"][0]["sim"]["levelled"]
    assert (levelled["rate"], levelled["prefill_x"], levelled["decode_x"]) == (40, 2.0, 1.5)
    assert "levelled_knee" in result["summary"]["pdserve-1p1d"]
    assert "(x2.00/x1.50)" in (out / "report.md").read_text()
    # the point's own steps (the fake's GET /admin/steps): kept, and their level predicted at
    own = point["runs"][0]["steps_level"]
    assert (own["prefill_x"], own["decode_x"]) == pytest.approx((2.0, 3.0))
    assert own["lone_steps"] == 12 and own["fallback"] == [] and own["missing"] == []
    kept = json.loads((out / "pdserve-1p1d" / "steps" / "rate-40-run1.json").read_text())
    assert set(kept["workers"]) == {"P0", "D0"}
    (stepped,) = result["systems"][0]["sim"]["stepped"]
    assert (stepped["prefill_x"], stepped["decode_x"]) == pytest.approx((2.0, 3.0))
    assert "stepped_knee" in result["summary"]["pdserve-1p1d"]
    assert "(x2.00/x3.00)" in (out / "report.md").read_text()
    # predicted again later: the recorded levels are used again
    assert main(["bench", "sweep-sim", str(out), "--cost-model", str(cm)]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["systems"][0]["sim"]["levelled"][0]["prefill_x"] == 2.0
    assert again["systems"][0]["sim"]["stepped"][0]["decode_x"] == pytest.approx(3.0)
    # the kept steps are priced again: D's twice as long now reads x6
    path = out / "pdserve-1p1d" / "steps" / "rate-40-run1.json"
    kept["workers"]["D0"] = [[a, 2 * b, *rest] for a, b, *rest in kept["workers"]["D0"]]
    path.write_text(json.dumps(kept))
    assert main(["bench", "sweep-sim", str(out), "--cost-model", str(cm)]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["systems"][0]["sim"]["stepped"][0]["decode_x"] == pytest.approx(6.0)
    probed.clear()
    assert main([*argv, "--no-level"]) == 0 and probed == []


def test_sim_of_a_command_line_serve_refuses_is_skipped(tmp_path: Path) -> None:
    from pdserve.bench import sweep_sim

    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    args = parser.parse_args(["--rates", "1", "--num-requests", "2", "--slo-ttft", "1",
                              "--slo-tpot", "1", "--output-dir", str(tmp_path),
                              "--pdserve-args=--no-such-flag"])  # fmt: skip
    assert "refuses" in sweep_sim.predict("pdserve-colocated", args)["skipped"]
