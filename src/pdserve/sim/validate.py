"""Simulated vs real on this machine: the same request list through a real `LocalCluster` and
through the simulator with this host's cost model, profiled right before (docs/benchmarks/sim.md).

    python -m pdserve.sim.validate --out docs/benchmarks/sim/validation.json

1. Profile: `pdserve bench profile --threads 1 --max-prompt 512 --contention` into the output
   folder (skipped with `--cost-model`), so the model and its contention factors are measured
   at the load the runs see; its raw samples go beside it (`costmodel-*-samples.json`).
2. Each configuration runs for real (worker processes, the default model, 1 thread each): two
   lone probe requests first (how fast the machine is right now), then the request list. The
   first configuration runs twice (A/A; `--aa all`: every one), so the run-to-run spread of the
   real system is measured beside the simulator's error.
3. Each run is simulated three ways: with the profile and its contention term ("sim"), as
   independent machines (`shared_host=False`, what the simulator did before the contention
   term) and at the run's own level ("calibrated": prefill and decode terms scaled by the
   median measured / priced time of the run's lone prefill and decode steps, from the
   workers' step logs: sim/level.py; contention on). The profile is minutes old by then and
   this VM's step times drift 5-25% in minutes: "calibrated" separates the simulator's error
   from the profile's. Runs stored before step logs existed calibrate from the probes' TTFT
   and TPOT instead (the factors say which: "from").

SLOs that test attainment: unless `--slo-ttft` / `--slo-tpot` are given, they are set from the
first configuration's probes (a lone request on this machine, right now): TTFT SLO =
`--slo-ttft-x` (1.5) x the lone TTFT (queueing may add at most half a lone prefill), TPOT SLO =
`--slo-tpot-x` (1.25) x the lone TPOT (sharing the decode steps may cost at most a quarter).
At 0.4 req/s a prompt often waits behind another and a request often shares D's steps, so
some requests miss and some meet: attainment lands between the extremes, where it tests the
simulator (with 3 s / 0.3 s every request met both, real and simulated). The first
configuration runs without the planner, so no routing depends on SLOs set after it started.

Real TTFT and TPOT are taken at the router: the arrival of each delta from
`RouterCore.generate`, as the simulator's are. The report prints, per configuration and metric,
real, simulated, the error and the A/A spread side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve.engine.request import SamplingParams
from pdserve.engine.step_log import StepRecord
from pdserve.sim.deploy import Deployment, build, simulate, summarize
from pdserve.sim.records import Record, SimRequest
from pdserve.sim.validate_report import compare, report, report_runs, side_by_side
from pdserve.sim.workload import arrivals, requests_from_items


@dataclass
class RealRun:
    records: list[Record]  # the request list's
    probes: list[Record]  # the lone requests before it
    steps: dict[str, list[StepRecord]] = field(default_factory=dict)  # worker -> its steps


@dataclass(frozen=True)
class Case:
    name: str
    deployment: Deployment


def cases() -> list[Case]:
    """The configurations (their SLOs are set per run: `deployment`)."""
    base = Deployment(hardware="cpu", model="default", max_num_seqs=64, message_s=0.001)
    return [
        Case("colocated x2", replace(base, prefill=0, decode=0, colocated=2)),
        Case("1P1D", replace(base, prefill=1, decode=1)),
        Case("1P1D + admission", replace(base, planner=True, admission=True)),
        Case("1P1D + conditional", replace(base, planner=True, disaggregation="conditional")),
    ]


def planner_for(d: Deployment) -> Any:
    from pdserve.costmodel.model import CostModel
    from pdserve.router.slo import SloPlanner
    from pdserve.sim.deploy import _cpu_steps

    if not d.planner:
        return None
    step, _ = _cpu_steps(d)
    assert isinstance(step.model, CostModel)
    return SloPlanner(
        step.model,
        slo_ttft_s=d.slo_ttft_s,
        slo_tpot_s=d.slo_tpot_s,
        admission=d.admission,
        mode=d.disaggregation,
        token_budget=d.max_batched_tokens,
        expected_output=d.expected_output,
    )


PROBE_BASE = 31000  # probe prompts' ids: clear of the synthetic workload's [1000, 30000)


def probe_requests(probe_len: int) -> list[SimRequest]:
    """The two lone requests sent before a run (none when `probe_len` is 0); they go through
    the planner, so the simulation runs them first too (`simulate(probes=...)`)."""
    return [
        SimRequest(f"probe{i}", 0.0, [PROBE_BASE + 97 * i + j for j in range(probe_len)], 8)
        for i in range(2 if probe_len else 0)
    ]


def run_real(d: Deployment, requests: list[SimRequest], probe_len: int = 0) -> RealRun:
    """The request list through a real cluster; first, if `probe_len`, two lone requests of
    that length one after the other (how fast this machine is right now). The workers' step
    logs from the probes on come back with the records."""
    from pdserve.cluster import LocalCluster
    from pdserve.router.core import RequestError

    core_args: dict[str, Any] = {}
    planner = planner_for(d)
    if planner is not None:
        core_args["planner"] = planner
    cluster = LocalCluster(
        prefill=d.prefill,
        decode=d.decode,
        colocated=d.colocated,
        threads=1,
        engine_args={"max_num_seqs": d.max_num_seqs},
        core_args=core_args,
    )
    records: dict[str, Record] = {
        r.rid: Record(r.rid, len(r.prompt), r.max_tokens, r.phase) for r in requests
    }

    async def one(req: SimRequest, t0: float) -> None:
        assert cluster.core is not None
        await asyncio.sleep(max(0.0, t0 + req.arrival - time.monotonic()))
        rec = records[req.rid]
        rec.arrival = time.monotonic() - t0
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        try:
            async for delta in cluster.core.generate(req.rid, list(req.prompt), params):
                now = time.monotonic() - t0
                if delta.token_ids:
                    rec.first_at = rec.first_at if rec.first_at is not None else now
                    rec.last_at = now
                    rec.tokens += len(delta.token_ids)
            rec.finished_at = time.monotonic() - t0
        except RequestError as e:
            rec.rejected = e.code
        # The route the real router chose (its scored prediction), set beside the simulated one.
        rec.route = cluster.core.timelines.predictions.get(req.rid, {}).get("route")

    probes = probe_requests(probe_len)
    for r in probes:
        records[r.rid] = Record(r.rid, len(r.prompt), r.max_tokens, None)

    marks = [time.monotonic()]

    async def all_of() -> None:
        for r in probes:
            await one(r, time.monotonic())
        t0 = time.monotonic()
        marks.append(t0)
        await asyncio.gather(*(one(r, t0) for r in requests))

    with cluster:
        assert cluster._loop is not None
        marks.append(time.monotonic())
        asyncio.run_coroutine_threadsafe(all_of(), cluster._loop).result(timeout=900)
        marks.append(time.monotonic())
        logs = cluster.step_logs(since=marks[1])
    marks.append(time.monotonic())
    steps = [b - a for a, b in itertools.pairwise(marks)]
    print("real run: start {:.0f} s, probes {:.0f} s, requests {:.0f} s, close {:.0f} s".format(
        *steps), flush=True)  # fmt: skip
    return RealRun([records[r.rid] for r in requests], [records[r.rid] for r in probes], logs)


def calibrated(d: Deployment, run: RealRun, folder: Path) -> tuple[Deployment, dict]:
    """The cost model at the run's own level (sim/level.py: prefill terms x the lone prefill
    steps' measured / priced median, decode terms x the decode steps'), saved beside the run
    with the profile's contention section. A run stored without step logs: scaled so that a
    lone request's TTFT and TPOT match the probes' instead."""
    from pdserve.costmodel.host_level import save_rescaled
    from pdserve.costmodel.model import CostModel
    from pdserve.sim.deploy import cost_model_path
    from pdserve.sim.level import run_level

    path = cost_model_path(d)
    model = CostModel.load(path)
    if run.steps:
        factors = run_level(model, run.steps)
    else:
        ttft, tpot = lone(run.probes)
        n = run.probes[0].prompt_len
        factors = {"from": "probes", "prefill_x": ttft / model.prefill_s(n)}
        factors["decode_x"] = tpot / model.decode_step_s(1, n + 4)
    # per-batch decode terms too; transfer, receive kept
    scaled = model.rescaled(factors["prefill_x"], factors["decode_x"])
    out = save_rescaled(path, scaled, folder / f"calibrated-{time.monotonic_ns()}.json")
    return replace(d, cost_model=out), factors


def profile(folder: Path, seconds: float, max_prompt: int = 512) -> Path:
    """A fresh cost model with its contention section, measured now (a subprocess: its engines
    and threads are gone before the clusters start), over prompts up to `max_prompt` tokens."""
    out = folder / f"costmodel-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.json"
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "profile", "--threads", "1"]
    cmd += ["--max-prompt", str(max_prompt), "--contention", "--contention-seconds", str(seconds)]
    samples = out.with_name(out.stem + "-samples.json")  # to refit or compare fits later
    subprocess.run([*cmd, "--out", str(out), "--samples-out", str(samples)], check=True)
    return out


def lone(probes: list[Record]) -> tuple[float, float]:
    """A lone request's TTFT and TPOT: the less disturbed (smaller) of the probes'."""
    ttfts = [r.ttft for r in probes if r.ttft]
    tpots = [r.tpot for r in probes if r.tpot]
    if not ttfts or not tpots:
        raise RuntimeError("the probe requests returned no timings")
    return min(ttfts), min(tpots)


def slos_from_probes(args: argparse.Namespace, probes: list[Record]) -> tuple[float, float]:
    """The SLOs: the given ones, else the multipliers x a lone request's TTFT and TPOT."""
    ttft, tpot = lone(probes)
    return (
        args.slo_ttft if args.slo_ttft is not None else round(args.slo_ttft_x * ttft, 3),
        args.slo_tpot if args.slo_tpot is not None else round(args.slo_tpot_x * tpot, 4),
    )


def run_reals(
    case: Case, requests: list[SimRequest], args: argparse.Namespace, repeats: int
) -> list[RealRun]:
    """The case's real runs, `repeats` of them (the SLOs, when set, in `args`)."""
    d = deployment(case, args)
    if d.planner and (d.slo_ttft_s is None or d.slo_tpot_s is None):
        raise SystemExit(
            f"{case.name!r} routes with the planner, which needs its SLOs before it starts: "
            "run a configuration without it first (colocated x2 or 1P1D) or give --slo-ttft "
            "and --slo-tpot"
        )
    return [run_real(d, requests, probe_len=args.input_len) for _ in range(repeats)]


def deployment(case: Case, args: argparse.Namespace) -> Deployment:
    return replace(
        case.deployment,
        expected_output=args.output_len,
        cost_model=args.cost_model,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
    )


def run_case(
    case: Case,
    requests: list[SimRequest],
    args: argparse.Namespace,
    runs: list[RealRun],
    fallback: list[Record],
) -> dict[str, Any]:
    """The real runs summarized at the SLOs, and the three simulations of the case
    (`fallback`: probes to calibrate from when admission refused the case's own and the run
    has no step log)."""
    d = deployment(case, args)
    sim_records: list[Record] = []
    probe_reqs = probe_requests(args.input_len)  # they taught the real planner before the run
    sim = simulate(d, requests, records_out=sim_records, probes=probe_reqs)
    independent = simulate(replace(d, shared_host=False), requests, probes=probe_reqs)
    reals, cals = [], []
    for run in runs:
        reals.append(summarize(run.records, d.slo_ttft_s, d.slo_tpot_s, d.gpus))
        probes = run.probes
        if not run.steps and not (any(r.ttft for r in probes) and any(r.tpot for r in probes)):
            # admission refused this case's probes (they pass through the planner too)
            print(f"{case.name}: probes refused, calibrated from the first run's", flush=True)
            run = replace(run, probes=fallback)
        cal_d, factors = calibrated(d, run, args.out.parent)
        # step times from the calibrated model; the planner predicts from the profiled one,
        # as the real router did
        cal = build(cal_d)
        cal.planner_model = build(d).planner_model
        cals.append(
            {"factors": factors, "sim": simulate(cal_d, requests, built=cal, probes=probe_reqs)}
        )
        print(case.name, "real TTFT", json.dumps(reals[-1]["ttft_s"]), factors, flush=True)
    row: dict[str, Any] = {
        "case": case.name,
        "sim": sim,
        "sim_independent": independent,
        "real": reals,
        "calibrated": cals,
        "vs": compare(reals[0], sim),
        "vs_independent": compare(reals[0], independent),
        "vs_calibrated": compare(reals[0], cals[0]["sim"]),
    }
    if len(reals) == 2:
        row["aa"] = compare(reals[0], reals[1])
    row["requests"] = side_by_side(runs[0].records, sim_records, d.slo_ttft_s, d.slo_tpot_s)
    # every real run's requests, probes and steps, so `--resimulate` can simulate them again
    row["real_records"] = [[asdict(r) for r in run.records] for run in runs]
    row["real_probes"] = [[asdict(r) for r in run.probes] for run in runs]
    row["real_steps"] = [_steps_wire(run) for run in runs]
    return row


def _steps_wire(run: RealRun) -> dict[str, list[list[float]]]:
    """A run's step logs for the output file, rounded to 0.1 ms / 10 us (half the bytes)."""
    out = {}
    for w, steps in run.steps.items():
        rows = []
        for s in steps:
            flat = s.to_wire()
            rows.append([round(flat[0], 4), round(flat[1], 5), *flat[2:]])
        out[w] = rows
    return out


def workload(args: argparse.Namespace) -> list[SimRequest]:
    """The request list of a validation: synthetic lengths (+-25%), Poisson arrivals; or a
    trace's window, scaled (`--trace`: prompts of token ids whose 512-token blocks, scaled,
    repeat where the trace's hash_ids do, as `bench replay --prompt-format ids` sends them)."""
    if getattr(args, "trace", None):
        from pdserve.sim.workload import scaling_from_args, trace_requests
        from pdserve.workloads.traces import read_trace

        return trace_requests(read_trace(args.trace, scaling_from_args(args)), args.seed)
    from pdserve.workloads.streams import SyntheticWorkload

    items = list(
        SyntheticWorkload(args.num_requests, args.input_len, args.output_len, 0.25, args.seed)
    )
    return requests_from_items(items, arrivals(len(items), args.rate, args.seed))


def stored_runs(row: dict[str, Any]) -> list[RealRun]:
    """The real runs kept in a validation output's result row, as `run_reals` returned them
    (without step logs when the file was written before they were kept)."""
    if "real_records" not in row:
        raise SystemExit(f"{row['case']!r}: no real_records in the file (written before they were)")
    steps = row.get("real_steps") or [{} for _ in row["real_records"]]
    return [
        RealRun(
            [Record(**r) for r in recs],
            [Record(**r) for r in probes],
            {w: [StepRecord.from_wire(s) for s in log] for w, log in by_worker.items()},
        )
        for recs, probes, by_worker in zip(
            row["real_records"], row["real_probes"], steps, strict=True
        )
    ]


def resimulate(args: argparse.Namespace) -> None:
    """Simulate again, with this code, the real runs stored in an earlier output: a change to
    the simulator is checked against the same measurements without running them again."""
    body = json.loads(args.resimulate.read_text())
    old = body["args"]
    for key in ("num_requests", "input_len", "output_len", "rate", "seed"):
        setattr(args, key, old[key])
    for key in ("trace", "limit", "start_ms", "length_scale", "time_scale"):
        if old.get(key) is not None:
            setattr(args, key, Path(old[key]) if key == "trace" else old[key])
    args.slo_ttft, args.slo_tpot = body["slo"]["ttft_s"], body["slo"]["tpot_s"]
    args.cost_model = args.cost_model or Path(old["cost_model"])
    requests = workload(args)
    by_name = {c.name: c for c in cases()}
    rows = body["results"]
    runs = [stored_runs(row) for row in rows]
    first = runs[0][0].probes
    results = [
        run_case(by_name[row["case"]], requests, args, r, first)
        for row, r in zip(rows, runs, strict=True)
    ]
    table, runs_table = report(results), report_runs(results)
    print(table, runs_table, sep="\n\n", flush=True)
    out = {k: v for k, v in body.items() if k not in ("results", "table", "runs_table")}
    out |= {"resimulated_from": str(args.resimulate), "cost_model": str(args.cost_model)}
    out |= {"resimulated_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out |= {"results": results, "table": table, "runs_table": runs_table}
    args.out.write_text(json.dumps(out, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--rate", type=float, default=0.4, help="requests/s (0.4)")
    p.add_argument("--slo-ttft", type=float, default=None,
                   help="seconds (default: --slo-ttft-x x a lone request's TTFT)")  # fmt: skip
    p.add_argument("--slo-tpot", type=float, default=None,
                   help="seconds (default: --slo-tpot-x x a lone request's TPOT)")  # fmt: skip
    p.add_argument("--slo-ttft-x", type=float, default=1.5)
    p.add_argument("--slo-tpot-x", type=float, default=1.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="replay this trace's window instead (Mooncake .jsonl or Azure .csv)",
    )
    p.add_argument("--limit", type=int, default=20, help="--trace: requests (20)")
    p.add_argument("--start-ms", type=float, default=0.0, help="--trace: the window's start")
    p.add_argument(
        "--length-scale",
        type=float,
        default=0.125,
        help="--trace: prompt, block and output lengths x this (0.125)",
    )
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="--trace: arrival times x this (2: half the rate)")  # fmt: skip
    p.add_argument("--only", default=None, help="comma-separated case names")
    p.add_argument("--aa", choices=("first", "all", "none"), default="first",
                   help="which configurations run twice for real (first)")  # fmt: skip
    p.add_argument("--cost-model", type=Path, default=None,
                   help="use this cost model instead of profiling first")  # fmt: skip
    # 3 s a phase measured decode beside decode at 1.00 where the runs after it showed 1.06-1.12
    p.add_argument("--contention-seconds", type=float, default=9.0, help="per phase (9)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--resimulate", type=Path, default=None, metavar="JSON",
                   help="no real runs: simulate again the real runs stored in this earlier "
                   "output (its workload, SLOs and cost model unless --cost-model)")  # fmt: skip
    args = p.parse_args(argv)
    if args.resimulate is not None:
        resimulate(args)
        return

    if args.num_requests < 1 or not args.rate > 0:
        raise SystemExit("--num-requests must be >= 1 and --rate > 0")
    if not (args.slo_ttft_x > 0 and args.slo_tpot_x > 0):
        raise SystemExit("--slo-ttft-x and --slo-tpot-x must be > 0")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    load_before = os.getloadavg()
    requests = workload(args)
    if args.cost_model is None:
        longest = max(len(r.prompt) for r in requests)  # the profile spans the prompts run
        args.cost_model = profile(args.out.parent, args.contention_seconds, max(512, longest))
    chosen = cases()
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - {c.name for c in chosen}
        if unknown:
            raise SystemExit(f"unknown case(s) {sorted(unknown)}: {[c.name for c in chosen]}")
        chosen = [c for c in chosen if c.name in names]
    runs = []
    for i, case in enumerate(chosen):
        repeats = 2 if args.aa == "all" or (args.aa == "first" and i == 0) else 1
        runs.append(run_reals(case, requests, args, repeats))
        if args.slo_ttft is None or args.slo_tpot is None:
            args.slo_ttft, args.slo_tpot = slos_from_probes(args, runs[0][0].probes)
            print(f"SLOs from the probes: TTFT {args.slo_ttft} s, TPOT {args.slo_tpot} s",
                  flush=True)  # fmt: skip
    first = runs[0][0].probes
    results = [run_case(c, requests, args, r, first) for c, r in zip(chosen, runs, strict=True)]
    table, runs_table = report(results), report_runs(results)
    print(table, runs_table, sep="\n\n", flush=True)
    from pdserve import hostinfo
    from pdserve.costmodel.contention import Contention
    from pdserve.costmodel.model import CostModel

    body = {
        "args": vars(args) | {"out": str(args.out), "cost_model": str(args.cost_model)},
        "cpu": hostinfo.cpu_model(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "wall_s": round(time.monotonic() - t0, 1),
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "probes": [[vars(p) for p in r.probes] for rr in runs for r in rr],
        "contention": Contention.load(args.cost_model).note,
        # the profile's fit errors: decode with its per-batch terms vs one linear fit, receive
        "profile_errors": CostModel.load_about(args.cost_model).get("errors"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "results": results,
        "table": table,
        "runs_table": runs_table,
    }
    args.out.write_text(json.dumps(body, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
