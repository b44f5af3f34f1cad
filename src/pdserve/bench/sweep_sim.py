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
"""

from __future__ import annotations

import argparse
import shlex
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
    from pdserve.serve.plan import cost_path
    from pdserve.sim.deploy import Deployment

    served = served_deployment(name, args)
    threads = served.topology.worker_threads(args.cores)
    path = args.cost_model or cost_path(served, threads)
    return Deployment.of(served, hardware="cpu", model=served.model or "default",
                         cost_model=Path(path))  # fmt: skip


def workload(args: argparse.Namespace, rate: float) -> list[Any]:
    from pdserve.sim.workload import make_requests

    ns = argparse.Namespace(
        workload=args.workload, num_requests=args.num_requests, input_len=args.input_len,
        output_len=args.output_len, len_spread=args.len_spread, seed=args.seed, rate=rate,
        arrival_cv=1.0, bench_arrivals=True, turns=getattr(args, "turns", 3), trace=None,
    )  # fmt: skip
    return make_requests(ns)


def predict(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """{"points": [{rate, attainment, goodput, ttft_ms, tpot_ms}], deployment, cost model} or
    {"skipped": why}."""
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
    points = []
    for rate in args.rates:
        records: list[Record] = []
        simulate(d, workload(args, rate), built=built, records_out=records)
        s = summarize(records, args.slo_ttft, args.slo_tpot, d.gpus)
        points.append({
            "rate": rate, "attainment": s["attainment"], "goodput": s["goodput_rps"],
            "ttft_ms": _ms(s["ttft_s"]), "tpot_ms": _ms(s["tpot_s"]),
        })  # fmt: skip
    return {"deployment": d.label(), "cost_model": str(d.cost_model), "points": points,
            "command": shlex.join(compare.SYSTEMS[name].command(args, 0))}  # fmt: skip


def _ms(stats: dict[str, float | None]) -> dict[str, float | None]:
    return {q: None if stats.get(q) is None else float(stats[q]) * 1e3  # type: ignore[arg-type]
            for q in ("p50", "p90", "p99")}  # fmt: skip
