"""`pdserve bench sched`: server commands per experiment and arm, the per-arm numbers and the
report from canned inputs (no server), and whole runs against a fake pdserve (FastAPI in a thread:
429s, timelines with predictions, /metrics, a worker that changes role) standing in for the
`pdserve serve` subprocesses."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from factories import serving
from pdserve.bench import (
    observe,
    sched,
    sched_calibrate,
    sched_report,
    sched_stats,
)
from pdserve.bench import sched_experiments as exps
from pdserve.bench.harness.servers import Launchable
from pdserve.workloads.streams import MixedWorkload

MODEL = "fake-pdserve"


# ---------------------------------------------------------------------------- a fake pdserve


class _State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests = 0
        self.rejected = 0
        self.done: list[str] = []
        self.role_p0 = "prefill"


def _fake_pdserve(state: _State) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL}]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        state.requests += 1
        k = state.requests
        if k % 4 == 0:  # every 4th: refused by "admission"
            state.rejected += 1
            err = {"message": "no", "type": "rate_limit_exceeded", "param": None,
                   "code": "slo_ttft"}  # fmt: skip
            return JSONResponse({"error": err}, status_code=429, headers={"Retry-After": "1"})
        if k == 6:
            state.role_p0 = "decode"  # "autobalance" moves P0 to the decode pool
        n = int(body["max_tokens"])
        rid = f"cmpl-{k}"

        async def stream() -> AsyncIterator[str]:
            for i in range(n):
                await asyncio.sleep(0.002)
                chunk = {"id": rid, "choices": [{"index": 0, "text": f" w{i}"}]}
                yield "data: " + json.dumps(chunk) + "\n\n"
            usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
            yield "data: " + json.dumps({"id": rid, "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
            state.done.append(rid)

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/v1/requests/{rid}/timeline")
    async def timeline(rid: str) -> Any:
        k = int(rid.removeprefix("cmpl-"))
        events = [{"event": "arrive", "worker": "", "t_ms": 0.0}]
        pred = {"route": "local" if k % 2 else "remote", "ttft_s": 0.01, "tpot_s": 0.004,
                "actual_ttft_s": 0.02, "actual_tpot_s": None,
                "cached_prefill_tokens": 2}  # fmt: skip
        return {"id": rid, "object": "request.timeline", "events": events, "prediction": pred}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        n = len(state.done)
        text = (
            "# TYPE pdserve_route_decisions counter\n"
            f'pdserve_route_decisions_total{{route="local"}} {n}\n'
            "# TYPE pdserve_kv_transfer_bytes counter\n"
            f'pdserve_kv_transfer_bytes_total{{side="send"}} {1000 * n}\n'
            f'pdserve_kv_transfer_bytes_total{{side="recv"}} {1000 * n}\n'
            "# TYPE pdserve_request_rejections counter\n"
            f'pdserve_request_rejections_total{{code="slo_ttft"}} {state.rejected}\n'
            "# TYPE pdserve_worker_prefix_cache_hit_rate gauge\n"
            'pdserve_worker_prefix_cache_hit_rate{worker="P0",role="prefill"} 0.25\n'
            'pdserve_worker_prefix_cache_hit_rate{worker="D0",role="decode"} 0.75\n'
            "# TYPE pdserve_ttft_seconds histogram\n"
            'pdserve_ttft_seconds_bucket{le="+Inf"} 1\n'
            "pdserve_ttft_seconds_count 1\npdserve_ttft_seconds_sum 0.1\n"
        )
        return PlainTextResponse(text)

    @app.get("/admin/workers")
    async def workers() -> list[dict[str, Any]]:
        return [
            {"id": "P0", "role": state.role_p0, "healthy": True, "queue": 0, "running": 0},
            {"id": "D0", "role": "decode", "healthy": True, "queue": 0, "running": 1},
        ]

    return app


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, _State]]:
    state = _State()
    with serving(_fake_pdserve(state)) as url:
        yield url, state


@pytest.fixture
def started(fake: tuple[str, _State], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`sched.server` yields the fake (fresh state each start) instead of starting pdserve."""
    url, state = fake
    names: list[str] = []

    @contextlib.contextmanager
    def server(system: Launchable, args: argparse.Namespace) -> Iterator[str]:
        names.append(system.name)
        system.command(args, 0)  # the command builds
        state.reset()
        yield url

    monkeypatch.setattr(sched, "server", server)
    return names


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sched.add_arguments(parser)
    return parser.parse_args(["--output-dir", "out", *extra])


# ---------------------------------------------------------------------------- commands, flags


def _flags(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("serve") + 1 :]


def test_server_commands_per_experiment_and_arm() -> None:
    args = _args("--pdserve-args", "--kv-codec int8")
    slo = (1.5, 0.05)
    adm = exps.EXPERIMENTS["admission"]
    a, b = (_flags(exps.server_command(args, adm, 9, arm, slo)) for arm in adm.arms)
    assert a[:8] == ["--prefill", "1", "--decode", "1", "--threads", "1", "--host", "127.0.0.1"]
    assert "--slo-ttft" in a and a[a.index("--slo-ttft") + 1] == "1.5"
    assert "--no-admission" not in a and a[-2:] == ["--kv-codec", "int8"]
    assert "--no-admission" in b and b[b.index("--slo-tpot") + 1] == "0.05"
    cond = exps.EXPERIMENTS["conditional"]
    c = _flags(exps.server_command(args, cond, 9, cond.arms[0], slo))
    assert c.count("--no-admission") == 1 and "conditional" in c
    cal = _flags(exps.server_command(args, cond, "PORT", None, None))
    assert "--slo-ttft" not in cal and "--disaggregation" not in cal and "PORT" in cal
    pre = exps.EXPERIMENTS["prefix"]
    p = _flags(exps.server_command(args, pre, 9, pre.arms[1], slo))
    assert p[:4] == ["--prefill", "2", "--decode", "2"] and "--no-prefix-routing" in p
    # --no-server-slos: only admission's servers get the SLOs
    quiet = _args("--no-server-slos", "--prefill", "3", "--model", "m.gguf")
    q = exps.server_command(quiet, pre, 9, pre.arms[0], slo)
    assert "--slo-ttft" not in q and "--no-admission" not in q and "m.gguf" in q
    assert _flags(q)[1:4] == ["--prefill", "3", "--decode"]
    assert "--slo-ttft" in exps.server_command(quiet, adm, 9, adm.arms[0], slo)
    auto = exps.EXPERIMENTS["autobalance"]
    assert "--autobalance" in exps.server_command(args, auto, 9, auto.arms[0], slo)
    assert "--autobalance" not in exps.server_command(args, auto, 9, auto.arms[1], slo)


def test_flags_and_settings() -> None:
    assert _args().experiment == list(exps.EXPERIMENTS)
    assert _args("--experiment", "all").experiment == list(exps.EXPERIMENTS)
    assert _args("--experiment", "prefix,admission").experiment == ["prefix", "admission"]
    with pytest.raises(SystemExit):
        _args("--experiment", "nope")
    pre = exps.EXPERIMENTS["prefix"]
    s = exps.settings(_args(), pre)
    assert s["workload"] == "multiturn" and s["turns"] == 4 and s["prompt_format"] == "text"
    assert s["multiturn_answers"] == "actual"
    assert exps.settings(_args("--turns", "2"), pre)["turns"] == 2
    mixed = exps.settings(_args("--long-fraction", "0.5"), exps.EXPERIMENTS["conditional"])
    assert mixed["long_fraction"] == 0.5 and mixed["short_len"] == (64, 200)
    ns = exps.bench_ns(_args(), pre, "http://x", num_requests=3, seed=1, rate=2.0, slo=(1, 2))
    assert ns.rate == 2.0 and ns.turns == 4 and ns.prompt_format == "text"
    assert (ns.slo_ttft, ns.slo_tpot) == (1, 2) and ns.backend == "pdserve"
    ns = exps.bench_ns(_args(), pre, "http://x", num_requests=3, seed=1, concurrency=4)
    assert ns.concurrency == 4 and ns.rate is None
    assert exps.load_factor(_args(), exps.EXPERIMENTS["admission"]) == 2.0
    assert exps.load_factor(_args("--load-factor", "3"), pre) == 3.0


def test_calibration_items_span_the_prompt_lengths() -> None:
    wl = MixedWorkload(40, seed=0, long_fraction=0.3)
    items = sched_calibrate.calibration_items(wl, 4)
    lens = sorted(len(it.prompt) for it in wl)
    assert len(items) == 4 and [it.conversation for it in items] == [0, 1, 2, 3]
    assert len(items[0].prompt) == lens[0] and len(items[-1].prompt) == lens[-1]
    assert all(it.question is None and it.turn == 0 for it in items)
    assert len(sched_calibrate.calibration_items(list(wl)[:2], 5)) == 2


# ---------------------------------------------------------------------------- per-arm numbers


def test_metrics_parsing_and_deltas() -> None:
    text = (
        "# TYPE pdserve_route_decisions counter\n"
        'pdserve_route_decisions_total{route="local"} 5\n'
        'pdserve_route_decisions_total{route="remote"} 2\n'
        "# TYPE pdserve_e2e_seconds histogram\n"
        'pdserve_e2e_seconds_bucket{le="+Inf"} 3\npdserve_e2e_seconds_count 3\n'
        "# TYPE other_metric gauge\nother_metric 1\n"
    )
    after = observe.parse_metrics(text)
    names = {s["name"] for s in after}
    assert "pdserve_e2e_seconds_bucket" not in names and "other_metric" not in names
    before = [{"name": "pdserve_route_decisions_total", "labels": {"route": "local"}, "value": 1}]
    delta = observe.metrics_delta(before, after)
    routes = sched_stats.by_label(
        delta, ["pdserve_disagg_decisions", "pdserve_route_decisions"], "route"
    )
    assert routes == {"local": 4.0, "remote": 2.0}
    assert sched_stats.by_label(delta, ["pdserve_nothing"], "x") is None
    assert sched_stats.by_label(None, ["pdserve_route_decisions"], "route") is None


def test_role_switches_from_polls() -> None:
    polls = [
        {"t_s": 0.0, "workers": [{"id": "P0", "role": "prefill"}, {"id": "D0", "role": "decode"}]},
        {"t_s": 1.0, "workers": [{"id": "P0", "role": "prefill"}, {"id": "D0"}]},
        {"t_s": 2.0, "workers": [{"id": "P0", "role": "decode"}, {"id": "D0", "role": "decode"}]},
        {"t_s": 3.0, "workers": [{"id": "P0", "role": "prefill"}]},
    ]
    assert observe.role_switches(polls) == [
        {"t_s": 2.0, "worker": "P0", "from": "prefill", "to": "decode"},
        {"t_s": 3.0, "worker": "P0", "from": "decode", "to": "prefill"},
    ]
    assert observe.role_switches([]) == []


def test_prediction_error_known_values() -> None:
    reqs: list[dict[str, Any]] = [
        {"prediction": {"ttft_s": 1.0, "tpot_s": 0.01, "actual_ttft_s": 2.0,
                        "actual_tpot_s": 0.01}},
        {"prediction": {"ttft_s": 3.0, "tpot_s": 0.03, "actual_ttft_s": None,
                        "actual_tpot_s": None}, "ttft_ms": 2000.0, "tpot_ms": 20.0},
        {"prediction": None, "ttft_ms": 5.0},
        {"ttft_ms": 5.0},
        {"prediction": {"ttft_s": 1.0, "actual_ttft_s": 0.0}},  # actual 0: left out
    ]  # fmt: skip
    err = sched_stats.prediction_error(reqs)
    assert err["with_prediction"] == 3
    assert err["ttft"]["n"] == 2 and err["ttft"]["p50"] == pytest.approx(0.5)  # 0.5 and 0.5
    assert err["tpot"]["n"] == 2 and err["tpot"]["p50"] == pytest.approx(0.25)  # 0 and 0.5
    assert err["tpot"]["p90"] == pytest.approx(0.45)
    empty = sched_stats.prediction_error([])
    assert empty["ttft"] == {"p50": None, "p90": None, "n": 0}


def _canned_arm(name: str, good_ttft: float) -> dict[str, Any]:
    reqs = [
        {"id": i, "send_s": 0.5 * i, "turn": i % 2, "phase": "prefill-heavy" if i < 2 else
         "decode-heavy", "error": None, "rejected": False, "ttft_ms": good_ttft + i,
         "tpot_ms": 10.0, "e2e_ms": 300.0, "reject_ms": None, "prompt_tokens": 100,
         "prediction": {"route": "local", "ttft_s": 0.1, "tpot_s": 0.01, "actual_ttft_s": 0.1,
                        "actual_tpot_s": 0.02, "cached_prefill_tokens": 25}}
        for i in range(4)
    ]  # fmt: skip
    reqs.append({"id": 4, "send_s": 2.0, "rejected": True, "reject_code": "slo_tpot",
                 "reject_ms": 3.0, "error": None, "ttft_ms": None, "turn": 0,
                 "phase": "decode-heavy"})  # fmt: skip
    return {
        "arm": name,
        "command": f"pdserve serve --{name}",
        "bench": {"requests": reqs, "duration_s": 2.0, "errors": [], "timelines_fetched": 4},
        "metrics": [
            {
                "name": "pdserve_worker_prefix_cache_hit_rate",
                "labels": {"worker": "P0", "role": "prefill"},
                "value": 0.5,
            },
        ],
        "metrics_delta": [
            {"name": "pdserve_kv_transfer_bytes_total", "labels": {"side": "send"}, "value": 2**20},
            {"name": "pdserve_route_decisions_total", "labels": {"route": "local"}, "value": 4},
            {"name": "pdserve_prefix_hits_total", "labels": {}, "value": 3},
        ],
        "workers": [
            {"id": "P0", "role": "decode", "prefix_cache_hit_rate": 0.4},
            {"id": "D0", "role": "decode", "stats": {"prefix_cache_hit_rate": 0.6}},
        ],
        "worker_polls": [
            {"t_s": 0.0, "workers": [{"id": "P0", "role": "prefill"}]},
            {"t_s": 1.0, "workers": [{"id": "P0", "role": "decode"}]},
        ],
    }


def test_summarize_arm_from_canned_results() -> None:
    s = sched_stats.summarize_arm(_canned_arm("a", 100.0), (0.1015, 0.015))
    assert (s["sent"], s["admitted"], s["rejected"], s["good"]) == (5, 4, 1, 2)
    assert s["goodput"] == pytest.approx(1.0) and s["slo_attainment_admitted"] == 0.5
    assert s["rejected_by_code"] == {"slo_tpot": 1}
    assert s["kv_bytes_sent"] == 2**20 and s["routes"] == {"local": 4.0}
    assert s["prefix"]["hit_rate_mean"] == pytest.approx(0.5)  # admin rows win over /metrics
    assert s["prefix"]["hit_rate_by_worker"] == {"P0": 0.4, "D0": 0.6}
    assert s["prefix"]["counters"] == {"pdserve_prefix_hits_total": 3}
    assert s["prefix"]["cached_share_predicted"] == pytest.approx(0.25)
    assert s["turns"]["later_turns"]["n"] == 2 and s["turns"]["per_turn"]["1"]["p50"] == 102.0
    assert s["role_switches"] == [{"t_s": 1.0, "worker": "P0", "from": "prefill", "to": "decode"}]
    assert s["roles_final"] == {"P0": "decode", "D0": "decode"}
    assert s["prediction_error"]["tpot"]["p50"] == pytest.approx(0.5)
    assert s["by_phase"]["prefill-heavy"]["good"] == 2
    assert s["by_phase"]["decode-heavy"]["rejected"] == 1
    # nothing from the server at all: numbers are None, never an exception
    bare = {"arm": "b", "bench": {"requests": [], "duration_s": 1.0}}
    s = sched_stats.summarize_arm(bare, (1.0, 1.0))
    assert (
        s["kv_bytes_sent"] is None and s["routes"] is None and s["prefix"]["hit_rate_mean"] is None
    )
    assert s["slo_attainment"] is None and s["role_switches"] == []


# ---------------------------------------------------------------------------- the report


def _canned_result() -> dict[str, Any]:
    arms = [_canned_arm("autobalance", 100.0), _canned_arm("static", 200.0)]
    for arm in arms:
        arm["summary"] = sched_stats.summarize_arm(arm, (0.1015, 0.015))
    return {
        "command": "pdserve bench sched --experiment autobalance,prefix,admission",
        "machine": {"cpu": "Test CPU", "cores": 2, "python": "3.11", "load_average": [0.5, 1, 1]},
        "started": "today",
        "wall_s": 12.0,
        "experiments": [
            {
                "name": "autobalance", "workload": {"workload": "shifting",
                "phase1_input_len": [10, 20]}, "topology": {"prefill": 1, "decode": 1,
                "threads": 1}, "slo": {"ttft_s": 0.1015, "tpot_s": 0.015, "how": "given"},
                "calibration": {"rate_how": "2 x capacity", "command": "pdserve serve cal"},
                "rate": 1.5, "burstiness": 1.0, "num_requests": 5, "arms": arms,
            },
            {
                "name": "prefix", "workload": {"workload": "multiturn"}, "topology": {},
                "slo": {}, "rate": 1.0, "num_requests": 5,
                "arms": [{"arm": "prefix-routing", "command": "x", "failed": "server exited"},
                         {"arm": "no-prefix", "command": "y", "failed": "server exited"}],
            },
            {"name": "admission", "workload": {}, "topology": {}, "arms": [],
             "failed": "calibration: server exited with 2"},
        ],
    }  # fmt: skip


def test_report_from_canned_results(tmp_path: Path) -> None:
    result = _canned_result()
    text = sched_report.build_report(result)
    assert "Test CPU, 2 cores" in text and "`pdserve bench sched --experiment" in text
    assert "## autobalance" in text and "phase1_input_len=10-20" in text
    assert "| metric | A: autobalance | B: static | A/B |" in text
    # the canned arms: 2 good of 5 in 2 s vs. 0 good (TTFT 200 ms > 150 ms)
    assert "| goodput (req/s) | 1.000 | 0.000 | inf |" in text
    assert "| goodput, prefill-heavy (req/s) |" in text
    assert "| role switches (count, polled) | 1 | 1 | 1.00x |" in text
    assert "P0 prefill->decode @1.0s" in text
    assert "| TTFT p50 (ms) | 102 | 202 | 0.50x |" in text
    assert "| role switches (server counter) | n/a | n/a | - |" in text
    assert "- arm autobalance: `pdserve serve --autobalance`" in text
    assert "- calibration server: `pdserve serve cal`" in text
    assert "- SLOs: TTFT 0.1015 s, TPOT 0.015 s (given)" in text
    assert "- load: 1.500 req/s, Poisson arrivals (2 x capacity), 5 requests per arm" in text
    assert "| sent | n/a | n/a | n/a |" in text  # the prefix arms failed: all n/a
    assert "- arm prefix-routing failed: server exited" in text
    assert "| prefix hit rate (workers, mean) | n/a | n/a | n/a |" in text
    assert "**not measured**: calibration: server exited with 2" in text
    path = tmp_path / "results.json"
    path.write_text(json.dumps(result))
    assert sched_report.rebuild(path) == text
    assert (tmp_path / "report.md").read_text() == text


def test_report_cells() -> None:
    assert sched_report.fmt(None, "rps") == "n/a" and sched_report.fmt("x", "ms") == "n/a"
    assert sched_report.fmt(0.5, "pct") == "50.0%" and sched_report.fmt(3 * 2**20, "bytes") == (
        "3.00 MiB"
    )
    assert sched_report.fmt({}, "dict") == "none" and sched_report.fmt({"a": 2.0}, "dict") == "a: 2"
    assert sched_report.ratio(1, 0) == "inf" and sched_report.ratio(0, 0) == "n/a"
    assert sched_report.ratio(None, 1) == "n/a" and sched_report.ratio(3, 2) == "1.50x"
    assert sched_report.ratio(float("nan"), 2) == "n/a"


# ---------------------------------------------------------------------------- whole runs, faked


def test_sched_run_against_a_fake_pdserve(started: list[str], tmp_path: Path) -> None:
    from pdserve.cli import main

    out = tmp_path / "sched"
    argv = [
        "bench", "sched", "--experiment", "admission,autobalance", "--output-dir", str(out),
        "--num-requests", "8", "--calibration-requests", "2", "--capacity-requests", "4",
        "--capacity-concurrency", "2", "--poll-interval", "0.02", "--input-len", "8",
        "--output-len", "3", "--phase1-input-len", "8,12", "--phase1-output-len", "2",
        "--phase2-input-len", "4", "--phase2-output-len", "4,6", "--prompt-format", "text",
    ]  # fmt: skip
    assert main(argv) == 0
    # admission: calibration, then both arms; autobalance the same
    assert started == [
        "admission-calibration", "admission-admission", "admission-no-admission",
        "autobalance-calibration", "autobalance-autobalance", "autobalance-static",
    ]  # fmt: skip
    result = json.loads((out / "results.json").read_text())
    assert result["command"].startswith("pdserve bench sched --experiment")
    assert result["machine"]["cores"] >= 1
    adm, auto = result["experiments"]
    cal = adm["calibration"]
    assert cal["slo"]["ttft_s"] > 0 and cal["capacity_rps"] > 0
    assert adm["rate"] == pytest.approx(2.0 * cal["capacity_rps"])
    assert "x the slowest unloaded TTFT" in cal["slo"]["how"]
    for exp in (adm, auto):
        assert exp["num_requests"] == 8
        for arm in exp["arms"]:
            s = arm["summary"]
            # the fake refuses every 4th request (the warm-up is the 1st): requests 4 and 8
            assert (
                s["sent"] == 8 and s["rejected"] == 2 and s["rejected_by_code"] == {"slo_ttft": 2}
            )
            assert s["rejection_latency_ms"]["p50"] > 0
            assert s["server_rejections"] == {"slo_ttft": 2.0}  # over the load, not warm-up
            assert s["kv_bytes_sent"] == 6000.0 and s["routes"] == {"local": 6.0}
            assert s["prefix"]["hit_rate_mean"] == pytest.approx(0.5)  # from /metrics
            assert s["prediction_error"]["ttft"]["p50"] == pytest.approx(0.5)
            assert s["prediction_error"]["with_prediction"] == 6
            assert s["timelines_fetched"] == 6
            # request 6 moved P0 to decode; the poller saw it
            assert [(x["worker"], x["to"]) for x in s["role_switches"]] == [("P0", "decode")]
            assert arm["worker_polls"][0]["workers"][0]["role"] == "prefill"
    phases = auto["arms"][0]["summary"]["by_phase"]
    assert list(phases) == ["prefill-heavy", "decode-heavy"]
    assert phases["prefill-heavy"]["sent"] == 4 and phases["decode-heavy"]["sent"] == 4
    report = (out / "report.md").read_text()
    assert "## admission" in report and "## autobalance" in report
    assert "| rejected | 2 | 2 | 1.00x |" in report
    assert "| rejected by code (client) | slo_ttft: 2 | slo_ttft: 2 | - |" in report
    assert "| goodput, decode-heavy (req/s) |" in report


def test_sched_reports_a_server_that_does_not_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    @contextlib.contextmanager
    def broken(system: Launchable, args: argparse.Namespace) -> Iterator[str]:
        raise RuntimeError("server exited with 2:\nunrecognized arguments: --autobalance")
        yield ""

    monkeypatch.setattr(sched, "server", broken)
    args = _args("--experiment", "autobalance", "--rate", "1", "--slo-ttft", "1",
                 "--slo-tpot", "0.1", "--num-requests", "2")  # fmt: skip
    args.output_dir = tmp_path
    assert sched.run(args, ["bench", "sched"]) == 1
    result = json.loads((tmp_path / "results.json").read_text())
    (exp,) = result["experiments"]
    assert exp["calibration"]["slo"]["how"] == "given on the command line"
    assert [a["failed"] for a in exp["arms"]] == [
        "server exited with 2:\nunrecognized arguments: --autobalance"
    ] * 2
    report = (tmp_path / "report.md").read_text()
    assert "| goodput (req/s) | n/a | n/a | n/a |" in report
    assert "unrecognized arguments: --autobalance" in report
