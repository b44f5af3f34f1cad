"""`pdserve bench sweep --sim`: the simulator's prediction of a sweep for a pdserve system.

The system's own `pdserve serve` command line is parsed by serve's flags into the deployment
it serves (`serve.flags.deployment`), and that becomes the simulated twin
(`sim.deploy.Deployment.of`): same pools, engine budgets, planner settings. Time comes from
this host's profiled cost model for the workers' thread count and engine settings (the file
`pdserve serve` itself would load: `serve.plan.cost_path`), or `--cost-model`. The requests
are the sweep's workload shape (`sim.workload`: rag is its shape, shared system prompt and
lengths, not its text) sent at the very times the measured point sent them (`bench serve`'s
Poisson gaps for that rate and `--seed`: `sim.workload.arrivals(bench=True)`); each point is
scored against the sweep's SLOs as the measured points are. Peers are reported as skipped;
pdserve-adaptive runs the router's thread policy in the simulator (`pdserve sim --adaptive`).
`pdserve bench sweep-sim DIR` makes the prediction again for a finished sweep (sweep_resim.py).

At the run's level: `host_level` times a few engine steps against the same cost model before
each measured point (costmodel/host_level.py); `predict` then simulates each rate a second
time with the workers' steps at that level (prefill terms x the median `prefill_x` of the
rate's repeats, decode terms x `decode_x`), the planner's cost model left at the profile's, as
the server loaded it. That prediction ("levelled") tells the simulator's queueing, batching
and policy apart from the host's speed drifting between the profile and the sweep. The probe
runs before the point, and the host can move during it: `steps_level` prices the workers' own
steps over the point (GET /admin/steps), the contention the simulator adds divided out
(sim/level.py), and "stepped" predicts each rate a third time at that level (a kind with
fewer than `sim.level.MIN_STEPS` steps at the probe's factor).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import subprocess
from pathlib import Path
from typing import Any

from pdserve.bench import compare


def served_deployment(name: str, args: argparse.Namespace) -> Any:
    """The `pdserve.deployment.Deployment` the system's `pdserve serve` command serves."""
    from pdserve.serve import flags as serve_flags

    argv = compare.SYSTEMS[name].command(args, 0)
    parser = argparse.ArgumentParser(add_help=False)
    serve_flags.add_serve_arguments(parser)
    return serve_flags.deployment(parser.parse_args(argv[2:]))  # after `pdserve serve`


def why_not(name: str, args: argparse.Namespace) -> str | None:
    """Why the simulator cannot predict this system, or None."""
    system = compare.SYSTEMS[name]
    if system.backend != "pdserve":
        return "a peer: the simulator models pdserve only"
    if system.missing(args) is not None:
        return system.missing(args)
    return None


def sim_deployment(name: str, args: argparse.Namespace) -> Any:
    from pdserve.sim.deploy import Deployment

    served, _, path = _served_profile(name, args)
    return Deployment.of(served, hardware="cpu", model=served.model or "default",
                         cost_model=path)  # fmt: skip


def _served_profile(name: str, args: argparse.Namespace) -> tuple[Any, int, Path]:
    """The served deployment, its workers' threads and the cost model the simulator prices."""
    from pdserve.serve.plan import cost_path

    served = served_deployment(name, args)
    threads = served.topology.worker_threads(args.cores)
    return served, threads, Path(args.cost_model or cost_path(served, threads))


def host_level(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """The host's level now against the cost model the system's prediction prices
    (costmodel/host_level.py); None for a system the simulator does not model, {"error": why}
    when the probe fails (the point is measured all the same)."""
    if why_not(name, args) is not None:
        return None
    from pdserve.costmodel import host_level as hl
    from pdserve.serve.plan import cost_settings

    try:
        served, threads, path = _served_profile(name, args)
        return hl.measure(path, served.model, threads, cost_settings(served)).as_dict()
    except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired, SystemExit) as e:
        return {"error": str(e) or type(e).__name__}


def steps_level(name: str, args: argparse.Namespace, logs: dict[str, Any]) -> dict[str, Any]:
    """The level the point ran at: its workers' engine steps (GET /admin/steps) priced by the
    cost model the prediction prices, the contention it adds divided out (sim/level.py
    `run_level`); {"error": why} when the server gave no steps or the model cannot be read."""
    if "error" in logs or "workers" not in logs:
        return {"error": str(logs.get("error", "no steps"))}
    from pdserve.costmodel.contention import Contention
    from pdserve.costmodel.model import CostModel
    from pdserve.engine import step_log
    from pdserve.sim.level import run_level

    try:
        _, threads, path = _served_profile(name, args)
        records = {w: step_log.from_wire(steps, (logs.get("threads") or {}).get(w) or [])
                   for w, steps in logs["workers"].items()}  # fmt: skip
        out = run_level(CostModel.load(path), records, Contention.load(path), threads)
    except (ValueError, OSError, TypeError) as e:
        return {"error": str(e) or type(e).__name__}
    return {**out, "missing": list(logs.get("missing") or [])}


def run_factors(run: dict[str, Any], source: str) -> tuple[float, float] | None:
    """A measured run's (prefill_x, decode_x): the probe's ("probe"), or its own steps'
    ("steps"), a kind with too few lone steps taking the probe's factor (None when the run
    has neither)."""
    probe = run.get("level") or {}
    probed = (probe["prefill_x"], probe["decode_x"]) if "prefill_x" in probe else None
    if source == "probe":
        return probed
    own = run.get("steps_level") or {}
    if "prefill_x" not in own:
        return None
    out = []
    for i, kind in enumerate(("prefill", "decode")):
        if kind not in own["fallback"]:
            out.append(own[f"{kind}_x"])
        elif probed is not None:
            out.append(probed[i])
        else:
            return None
    return out[0], out[1]


def levels(system: dict[str, Any], source: str = "probe") -> dict[float, tuple[float, float]]:
    """Per rate: the median (prefill_x, decode_x) over the measured repeats (`run_factors`)."""
    out = {}
    for p in system.get("points") or []:
        got = [f for r in p.get("runs") or [] if (f := run_factors(r, source)) is not None]
        if got:
            out[p["rate"]] = (statistics.median(g[0] for g in got),
                              statistics.median(g[1] for g in got))  # fmt: skip
    return out


def at_level(built: Any, prefill_x: float, decode_x: float, planner: bool = False,
             planner_x: tuple[float, float] | None = None) -> Any:  # fmt: skip
    """`built` with the workers' steps rescaled; the planner keeps the profile's model unless
    `planner` (a server started with `--level-probe` plans at its own probe's level:
    `planner_x`, default the workers')."""

    def rescale(step: Any) -> Any:
        return dataclasses.replace(step, model=step.model.rescaled(prefill_x, decode_x))

    out = dataclasses.replace(built, step=rescale(built.step),
                              prefill_step=rescale(built.prefill_step))  # fmt: skip
    if planner and built.planner_model is not None:
        out.planner_model = built.planner_model.rescaled(*(planner_x or (prefill_x, decode_x)))
    return out


def workload(args: argparse.Namespace, rate: float) -> list[Any]:
    from pdserve.sim.workload import make_requests

    ns = argparse.Namespace(
        workload=args.workload, num_requests=args.num_requests, input_len=args.input_len,
        output_len=args.output_len, len_spread=args.len_spread, seed=args.seed, rate=rate,
        arrival_cv=1.0, bench_arrivals=True, turns=getattr(args, "turns", 3), trace=None,
    )  # fmt: skip
    return make_requests(ns)


def predict(name: str, args: argparse.Namespace,
            level: dict[float, tuple[float, float]] | None = None,
            stepped: dict[float, tuple[float, float]] | None = None) -> dict[str, Any]:  # fmt: skip
    """{"points": [{rate, attainment, goodput, ttft_ms, tpot_ms}], deployment, cost model} or
    {"skipped": why}; with `level` (per rate: prefill_x, decode_x, probed before the point)
    also "levelled": the points of the rates it holds, predicted at that level; with `stepped`
    (the points' own steps) also "stepped", the same at the level the points ran."""
    why = why_not(name, args)
    if why is not None:
        return {"skipped": why}
    from pdserve.sim.deploy import build, simulate, summarize
    from pdserve.sim.records import Record

    try:
        d = sim_deployment(name, args)
        built = build(d)
    except (ValueError, OSError) as e:  # no profile on this host: said, not fatal
        return {"skipped": f"cannot simulate: {e}"}
    except SystemExit:  # serve's parser refused the command line (its error is on stderr)
        return {"skipped": "cannot simulate: `pdserve serve` refuses this command line"}

    def point(rate: float, b: Any) -> dict[str, Any]:
        records: list[Record] = []
        simulate(d, workload(args, rate), built=b, records_out=records)
        s = summarize(records, args.slo_ttft, args.slo_tpot, d.gpus)
        return {
            "rate": rate, "attainment": s["attainment"], "goodput": s["goodput_rps"],
            "ttft_ms": _ms(s["ttft_s"]), "tpot_ms": _ms(s["tpot_s"]),
        }  # fmt: skip

    out = {"deployment": d.label(), "cost_model": str(d.cost_model),
           "points": [point(rate, built) for rate in args.rates],
           "command": shlex.join(compare.SYSTEMS[name].command(args, 0))}  # fmt: skip
    probed = served_deployment(name, args).planner.level_probe
    for key, at in (("levelled", level or {}), ("stepped", stepped or {})):
        rates = [r for r in args.rates if r in at]
        if rates:
            out[key] = [{**point(r, at_level(built, *at[r], probed, (level or {}).get(r))),
                         "prefill_x": at[r][0], "decode_x": at[r][1]} for r in rates]  # fmt: skip
    return out


def _ms(stats: dict[str, float | None]) -> dict[str, float | None]:
    return {q: None if stats.get(q) is None else float(stats[q]) * 1e3  # type: ignore[arg-type]
            for q in ("p50", "p90", "p99")}  # fmt: skip
