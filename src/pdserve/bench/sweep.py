"""`pdserve bench sweep`: goodput and SLO attainment against the request rate for several systems
in one run, and each curve's knee.

    pdserve bench sweep --systems pdserve-colocated,pdserve-1p1d,pdserve-adaptive,vllm-cpu \\
        --workload rag --input-len 900 --output-len 64 --rates 0.1,0.2,0.3,0.4,0.6 \\
        --slo-ttft 6 --slo-tpot 0.1 --num-requests 40 --repeats 3 --sim --output-dir D

Systems are `bench compare`'s (`--systems`; pdserve-adaptive is `pdserve serve --adaptive`),
started the same way: each point (a system at a rate) runs on a freshly started server after
one warm-up request, so no point profits from a prefix cache another warmed. A system this
machine lacks (vLLM's venv absent, no --adaptive in this checkout) is reported as skipped.

Point order: `--order interleaved` (the default) runs every system at one rate before the next
rate, the systems' order rotated by one at each rate and repeat, so that a slow drift of the
host's speed does not favour the system that always runs first; `--order random` shuffles all
points (seeded by `--seed`). `--repeats K` runs every point K times on the same requests; the
report gives each point's median and min-max, the run-to-run spread a difference between
systems has to exceed.

SLOs are required (`--slo-ttft`, `--slo-tpot`): a request is good when it completed within
both. Attainment is good / sent; goodput is good requests per second of the phase.

The knee of a curve: the request rate at which SLO attainment falls below `--knee-attainment`
(0.9), interpolated linearly between the last measured rate at or above it and the first rate
below it (rates in increasing order, median attainment over repeats). Every point above: the
knee is at least the highest rate; the lowest rate already below: none.

`--sim` adds the simulator's prediction of the same sweep for the pdserve systems (same
workload, SLOs and threads; this host's profiled cost model, as `pdserve sim --hardware cpu`
finds it, or `--cost-model`): its points, dashed in the plot, and its knee with the error
against the measured knee (`sweep_sim`). Before each pdserve point it also times a few engine
steps against that cost model (`costmodel/host_level.py`, ~10 s; `--no-level` skips it): the
point's "level", with which the simulator predicts the sweep again at the speed the host ran
the point (a shared VM's speed moves by more than the simulator's targets between a profile
and a sweep). After each such point it also reads the workers' own engine steps over the load
(GET /admin/steps): their level where the point ran ("steps_level", sim/level.py), and a third
prediction at it.

Writes under `--output-dir`: `<system>/rate-<r>.json` per point (the median run's rate,
completed, refused (answered 429/503 by the server's admission), failed, goodput, attainment,
TTFT and TPOT p50/p90/p99, the server's and this command; every repeat under "runs"), the
per-request records under `<system>/requests/`, the workers' steps under `<system>/steps/`,
`summary.json`, `report.md` (knees, points) and `sweep.png`; server logs under `logs/`.
"""

from __future__ import annotations

import argparse
import random
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve import argtypes
from pdserve.bench import compare, peers, sweep_report
from pdserve.bench.harness import report

DEFAULT_SYSTEMS = ("pdserve-colocated", "pdserve-1p1d", "pdserve-adaptive", "vllm-cpu")
ORDERS = ("interleaved", "random")
POINT_KEYS = ("completed", "failed", "good", "goodput", "duration_s")
LATENCY_KEYS = ("ttft_ms", "tpot_ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--systems", type=compare._systems, default=list(DEFAULT_SYSTEMS),
      help="comma-separated, from bench compare's systems")  # fmt: skip
    compare.add_run_arguments(parser)
    a("--slo-ttft", type=argtypes.positive_float, required=True, help="TTFT SLO, s")
    a("--slo-tpot", type=argtypes.positive_float, required=True, help="TPOT SLO, s")
    a("--repeats", type=argtypes.positive_int, default=1,
      help="runs of every point (median and min-max reported)")  # fmt: skip
    a("--order", choices=ORDERS, default="interleaved",
      help="interleaved: all systems per rate, rotated; random: seeded shuffle")  # fmt: skip
    a("--knee-attainment", type=argtypes.fraction, default=0.9,
      help="the knee: where SLO attainment falls below this (interpolated)")  # fmt: skip
    a("--sim", action="store_true", help="add the simulator's prediction (pdserve systems)")
    a("--cost-model", type=Path, default=None,
      help="--sim: the profiled cost model (default: this host's, per thread count)")  # fmt: skip
    a("--no-level", action="store_true",
      help="--sim: no host-level probe before each pdserve point")  # fmt: skip


# ---------------------------------------------------------------------------- order


def plan(systems: Sequence[str], rates: Sequence[float], repeats: int, order: str, seed: int
         ) -> list[tuple[int, float, str]]:  # fmt: skip
    """Every (repeat, rate, system) point in the order they run (see the module doc)."""
    if order not in ORDERS:
        raise ValueError(f"--order must be one of {ORDERS}, got {order!r}")
    points = []
    turn = 0
    for rep in range(repeats):
        for rate in rates:
            k = turn % max(len(systems), 1)
            points += [(rep, rate, name) for name in [*systems[k:], *systems[:k]]]
            turn += 1
    if order == "random":
        random.Random(seed).shuffle(points)
    return points


# ---------------------------------------------------------------------------- points


def point_stats(res: dict[str, Any], rate: float, repeat: int) -> dict[str, Any]:
    """What a point's JSON keeps of one load phase (after `compare.apply_slos`)."""
    out: dict[str, Any] = {"rate": rate, "repeat": repeat}
    out.update({k: res[k] for k in POINT_KEYS})
    # answered 429/503 by the server's admission: neither completed nor failed, never good
    out["refused"] = int(res.get("rejected") or 0)
    out["attainment"] = res["good_fraction"]
    for key in LATENCY_KEYS:
        out[key] = {q: res[key].get(q) for q in ("p50", "p90", "p99")}
    return out


def point_json(name: str, rate: float, command: list[str], runs: list[dict[str, Any]],
               sweep_command: str) -> dict[str, Any]:  # fmt: skip
    """One point's file: the median run's numbers on top (by attainment), every run below."""
    ranked = sorted(runs, key=lambda r: (r["attainment"], r["goodput"]))
    median = ranked[(len(ranked) - 1) // 2] if ranked else {}
    return {
        "system": name,
        **{k: v for k, v in median.items() if k != "repeat"},
        "rate": rate,
        "command": shlex.join(command),
        "sweep_command": sweep_command,
        "spread": sweep_report.spread(runs) if runs else None,
        "runs": runs,
    }


def rate_name(rate: float) -> str:
    return f"rate-{rate:g}"


def run_point(system: peers.System, args: argparse.Namespace, rate: float, rep: int
              ) -> dict[str, Any]:  # fmt: skip
    """One load phase on a fresh server, scored against the SLOs; its requests saved."""
    label = f"rate {rate:g}" + (f" #{rep + 1}" if args.repeats > 1 else "")
    level = None
    if args.sim and not args.no_level:  # the host's speed now, before the server starts
        from pdserve.bench import sweep_sim

        level = sweep_sim.host_level(system.name, args)
    res = compare.run_phase(system, args, label, num_requests=args.num_requests,
                            seed=args.seed, rate=rate, steps=level is not None)  # fmt: skip
    compare.apply_slos(res, args.slo_ttft, args.slo_tpot)
    run = f"{rate_name(rate)}-run{rep + 1}.json"
    report.write_json(args.output_dir / system.name / "requests" / run, res["requests"], indent=1)
    stats = point_stats(res, rate, rep)
    if level is not None:
        from pdserve.bench import sweep_sim

        logs = res.pop("step_logs", {})
        report.write_json(args.output_dir / system.name / "steps" / run, logs)
        stats["level"] = level
        stats["steps_level"] = sweep_sim.steps_level(system.name, args, logs)
    return stats


def run_points(args: argparse.Namespace, command: str) -> list[dict[str, Any]]:
    """Every point of every available system, in `plan` order; one JSON per point, rewritten
    as its repeats come in (a sweep stopped midway keeps what it measured)."""
    systems: dict[str, dict[str, Any]] = {}
    for name in args.systems:
        system = compare.SYSTEMS[name]
        why = system.missing(args)
        systems[name] = (
            {"name": name, "skipped": why}
            if why
            else {"name": name, "command": system.command(args, 0), "runs": {}, "failed": {}}
        )
        if why:
            print(f"  {name}: skipped: {why}", flush=True)
    live = [n for n in args.systems if not systems[n].get("skipped")]
    for rep, rate, name in plan(live, args.rates, args.repeats, args.order, args.seed):
        s = systems[name]
        try:
            stats = run_point(compare.SYSTEMS[name], args, rate, rep)
        except RuntimeError as e:  # a server that cannot start or serve: that point failed
            print(f"  {name} rate {rate:g}: failed: {e}", flush=True)
            s["failed"][rate] = str(e)
            continue
        runs = s["runs"].setdefault(rate, [])
        runs.append(stats)
        point = point_json(name, rate, s["command"], runs, command)
        report.write_json(args.output_dir / name / f"{rate_name(rate)}.json", point)
    return [_system_result(systems[n], args.rates, command) for n in args.systems]


def _system_result(s: dict[str, Any], rates: Sequence[float], command: str) -> dict[str, Any]:
    if s.get("skipped"):
        return s
    points = []
    for rate in rates:
        runs = s["runs"].get(rate, [])
        point = point_json(s["name"], rate, s["command"], runs, command)
        if not runs:
            point["failed"] = s["failed"].get(rate, "not run")
        points.append(point)
    return {"name": s["name"], "command": shlex.join(s["command"]), "points": points}


# ---------------------------------------------------------------------------- run


def check(args: argparse.Namespace) -> None:
    compare.check_prompts(argparse.Namespace(**{**vars(args), "unloaded_requests": 1}))
    if len(set(args.rates)) != len(args.rates):
        raise ValueError(f"--rates has a rate twice: {args.rates}")


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    if args.tokenizer is None and args.model is not None:
        args.tokenizer = str(args.model)
    check(args)
    if any(compare.SYSTEMS[name].hf_folder for name in args.systems):
        args.hf_model = peers.export_hf_folder(args.hf_model, args.model)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    command = report.command_line(argv)
    t0 = time.time()
    machine = report.host()
    systems = run_points(args, command)
    if args.sim:
        from pdserve.bench import sweep_sim

        for s in systems:
            try:
                s["sim"] = sweep_sim.predict(s["name"], args, sweep_sim.levels(s),
                                             sweep_sim.levels(s, "steps"))  # fmt: skip
            except Exception as e:  # hours of measurement are written whatever the sim does
                s["sim"] = {"skipped": f"simulation failed: {e!r}"}
    machine["load_average_end"] = report.load_average()
    result = {
        "command": command,
        "machine": machine,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t0)),
        "wall_s": time.time() - t0,
        "workload": {k: getattr(args, k) for k in compare.WORKLOAD_KEYS},
        "rates": args.rates,
        "cores": args.cores,
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "order": args.order,
        "repeats": args.repeats,
        "knee_attainment": args.knee_attainment,
        "systems": systems,
    }
    print(sweep_report.write(result, args.output_dir))
    return 0 if any(p.get("runs") for s in systems for p in s.get("points", [])) else 1
