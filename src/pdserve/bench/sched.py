"""`pdserve bench sched`: pdserve's scheduling features (issue 6), each against its baseline.

Every experiment starts `pdserve serve` twice as a subprocess, a fresh server each time (arm A with
the feature, arm B without), waits for /v1/models and /health, sends one warm-up request, then
runs the same seeded workload against it with `bench serve` (`serve_bench`) while polling
GET /admin/workers every `--poll-interval` seconds; after the load it fetches /metrics (counters
are reported as the difference across the load, so the warm-up is not counted), /admin/workers and
every request's GET /v1/requests/{id}/timeline (its events and, when the server has one, its
cost-model "prediction").

  admission    synthetic, 1P+1D: `--slo-ttft X --slo-tpot Y` (admission on) vs the same plus
               `--no-admission`; Poisson load at `--load-factor` (2) x the measured capacity.
               Attainment of admitted requests, goodput, rejections by code, rejection latency.
  conditional  mixed (short and long prompts, short answers), 1P+1D: `--disaggregation
               conditional` vs `always`: goodput (all, short, long), TTFT/TPOT medians, route
               decisions (pdserve_route_decisions / _disagg_decisions, else the timelines' routes).
  prefix       multiturn (actual answers carried, text prompts, `user` = conversation), 2P+2D:
               `--prefix-routing` vs `--no-prefix-routing`: prefix-cache hit rate (worker stats,
               router counters), TTFT p50/p90 of turns > 0 (and per turn), KV bytes sent.
  autobalance  shifting (long prompts + short answers, then short prompts + long answers),
               1P+1D: `--autobalance` vs not: goodput per phase and overall, role switches seen
               in the polled worker table (who, when, from -> to).
All experiments report the cost model's prediction error from the timelines: p50/p90 of
|predicted - actual| / actual for TTFT and TPOT (the server's actual values when the prediction
carries them, else the client's measurements).

SLOs and load. `--slo-ttft`/`--slo-tpot` when given; else derived like `bench compare`: a
calibration server (the plain `pdserve serve` of that topology: no arm flags, no SLOs) answers
`--calibration-requests` requests one at a time (spread over the workload's prompt lengths: the
shortest, the longest and evenly between), and each SLO is its factor (`--slo-ttft-factor` 3,
`--slo-tpot-factor` 1.5) x the slowest of them, so every kind of request meets the SLOs when the
server is idle. The same server then measures capacity: a closed-loop run (`--capacity-requests`
requests of the workload, another seed, at most `--capacity-concurrency` in flight, default
2 x the workers) whose completed requests/s is the capacity; the load is `--load-factor` x that
(`--rate` skips the measurement). Requests: `--num-requests`, else `--duration` x the rate, else
the experiment's default. The SLOs go to every server (`--no-server-slos`: only admission's);
experiments other than admission also get `--no-admission`, so that both arms serve everything
and differ only in the feature measured.

Everything degrades gracefully: a server that does not start (say, a flag not landed yet) is
reported as failed, and any number whose field the server does not provide is "n/a". Writes
`results.json` (after each experiment) and `report.md` under `--output-dir`, server logs under
`logs/`. `sched_report.rebuild(results.json)` re-makes the report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shlex
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from pdserve import argtypes
from pdserve.bench import sched_calibrate
from pdserve.bench.harness import report
from pdserve.bench.harness.servers import (
    Launchable,
    Server,
    fetch_timelines,
    run_load,
    running_server,
    wait_healthy,
)
from pdserve.bench.observe import WorkerPoller, get, metrics_delta, scrape_metrics
from pdserve.bench.sched_experiments import (
    EXPERIMENTS,
    Arm,
    Experiment,
    bench_ns,
    parse_experiments,
    server_command,
    settings,
    topology,
    warm_up,
)
from pdserve.bench.sched_stats import summarize_arm
from pdserve.workloads import streams as wl

HEALTH_WAIT_S = 60.0


# ---------------------------------------------------------------------------- servers


def _system(
    args: argparse.Namespace,
    exp: Experiment,
    label: str,
    arm: Arm | None,
    slo: tuple[float, float] | None,
) -> Server:
    def command(_: argparse.Namespace, port: int) -> list[str]:
        return server_command(args, exp, port, arm, slo)

    return Server(f"{exp.name}-{label}", command)


@contextlib.contextmanager
def server(system: Launchable, args: argparse.Namespace) -> Iterator[str]:
    """`running_server` (free port, /v1/models, stop), then /health "ok"."""
    log = args.output_dir / "logs" / f"{system.name}.log"
    with running_server(system, args, log) as url:
        wait_healthy(url, HEALTH_WAIT_S)
        yield url


# ---------------------------------------------------------------------------- one arm


def calibrate(args: argparse.Namespace, exp: Experiment) -> dict[str, Any]:
    """SLOs and the load rate: given, or measured on a plain server (see the module doc)."""
    out: dict[str, Any] = {}
    if any(sched_calibrate.needs(args)):
        out["command"] = shlex.join(server_command(args, exp, "PORT", None, None))
        with server(_system(args, exp, "calibration", None, None), args) as url:
            warm_up(args, exp, url)
            out.update(sched_calibrate.measure(args, exp, url))
    return sched_calibrate.decide(args, exp, out)


def run_arm(
    args: argparse.Namespace,
    exp: Experiment,
    arm: Arm,
    slo: tuple[float, float],
    rate: float,
    num_requests: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "arm": arm.name,
        "command": shlex.join(server_command(args, exp, "PORT", arm, slo)),
    }
    print(f"  {exp.name}/{arm.name}: {out['command']}", flush=True)
    try:
        with server(_system(args, exp, arm.name, arm, slo), args) as url:
            warm_up(args, exp, url)
            before = scrape_metrics(url)
            ns = bench_ns(
                args, exp, url, num_requests=num_requests, seed=args.seed, rate=rate, slo=slo
            )
            with WorkerPoller(url, args.poll_interval) as poller:
                res = run_load(ns)
            after = scrape_metrics(url)
            resp = get(url, "/admin/workers")
            workers = resp.json() if resp is not None and resp.status_code == 200 else None
            res["timelines_fetched"] = asyncio.run(fetch_timelines(url, res["requests"]))
    except (RuntimeError, httpx.HTTPError, ValueError, OSError) as e:
        print(f"  {exp.name}/{arm.name}: failed: {e}", flush=True)
        out["failed"] = str(e)
        return out
    out["bench"] = res
    out["metrics"] = after
    out["metrics_delta"] = metrics_delta(before, after) if before and after else None
    out["workers"] = workers
    out["worker_polls"] = poller.samples
    out["summary"] = summarize_arm(out, slo)
    print(f"  {exp.name}/{arm.name}: {_one_line(out['summary'])}", flush=True)
    return out


def _one_line(s: dict[str, Any]) -> str:
    def f(v: Any, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    return (
        f"sent {s['sent']} rejected {s['rejected']} good {s['good']} goodput "
        f"{f(s['goodput'], '.3f')} req/s TTFT p50 {f(s['ttft_ms']['p50'], '.0f')} ms "
        f"TPOT p50 {f(s['tpot_ms']['p50'], '.1f')} ms"
    )


# ---------------------------------------------------------------------------- the run


def run_experiment(args: argparse.Namespace, exp: Experiment) -> dict[str, Any]:
    p, d = topology(exp, args)
    out: dict[str, Any] = {
        "name": exp.name,
        "workload": settings(args, exp),
        "topology": {"prefill": p, "decode": d, "threads": args.threads},
        "arms": [],
    }
    print(f"{exp.name}: {p}P+{d}D, workload {exp.workload}", flush=True)
    try:
        cal = calibrate(args, exp)
    except (RuntimeError, httpx.HTTPError, ValueError, OSError) as e:
        print(f"  {exp.name}: calibration failed: {e}", flush=True)
        out["failed"] = f"calibration: {e}"
        return out
    out["calibration"] = cal
    slo = (cal["slo"]["ttft_s"], cal["slo"]["tpot_s"])
    rate = float(cal["rate"])
    n = args.num_requests or (math.ceil(rate * args.duration) if args.duration else None)
    n = max(1, n or exp.num_requests)
    out["slo"], out["rate"], out["num_requests"] = cal["slo"], rate, n
    out["burstiness"] = args.burstiness
    print(f"  SLO TTFT {slo[0]:.3f} s TPOT {slo[1]:.4f} s, rate {rate:.3f}/s, {n} requests")
    out["arms"] = [run_arm(args, exp, arm, slo, rate, n) for arm in exp.arms]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pos_int, pos_float = argtypes.positive_int, argtypes.positive_float
    parser.add_argument(
        "--experiment",
        type=parse_experiments,
        default=list(EXPERIMENTS),
        help=f"{' | '.join(EXPERIMENTS)} | all (or a comma-separated list); default all",
    )
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default: SmolLM2")
    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=pos_int, default=None, help="per arm")
    load.add_argument(
        "--duration", type=pos_float, default=None, help="s of load per arm: rate x this requests"
    )
    load.add_argument("--rate", type=pos_float, default=None, help="req/s; default: calibrated")
    load.add_argument(
        "--load-factor", type=pos_float, default=None, help="x capacity (admission 2, others 1)"
    )
    load.add_argument("--burstiness", type=pos_float, default=1.0, help="1: Poisson")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--capacity-requests", type=pos_int, default=None, help="default 3 x conc.")
    load.add_argument(
        "--capacity-concurrency", type=pos_int, default=None, help="default 2 x workers"
    )
    load.add_argument("--calibration-requests", type=pos_int, default=4)
    slo = parser.add_argument_group("SLOs")
    slo.add_argument("--slo-ttft", type=pos_float, default=None, help="s; default: calibrated")
    slo.add_argument("--slo-tpot", type=pos_float, default=None, help="s; default: calibrated")
    slo.add_argument("--slo-ttft-factor", type=pos_float, default=3.0)
    slo.add_argument("--slo-tpot-factor", type=pos_float, default=1.5)
    slo.add_argument(
        "--server-slos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pass the SLOs to every server (with --no-admission outside the admission "
        "experiment); else only to admission's",
    )
    srv = parser.add_argument_group("servers")
    srv.add_argument("--prefill", type=pos_int, default=None, help="default: the experiment's")
    srv.add_argument("--decode", type=pos_int, default=None, help="default: the experiment's")
    srv.add_argument("--threads", type=pos_int, default=1, help="torch threads per worker")
    srv.add_argument("--pdserve-args", default="", help="extra flags for every `pdserve serve`")
    srv.add_argument("--startup-timeout", type=pos_float, default=600.0)
    srv.add_argument("--timeout", type=pos_float, default=300.0, help="per request, s")
    srv.add_argument("--poll-interval", type=pos_float, default=1.0, help="/admin/workers, s")
    work = parser.add_argument_group("workload (default: the experiment's)")
    work.add_argument("--input-len", type=pos_int, default=None)
    work.add_argument("--output-len", type=pos_int, default=None)
    work.add_argument("--len-spread", type=argtypes.fraction, default=None)
    work.add_argument("--turns", type=pos_int, default=None)
    work.add_argument("--prompt-format", choices=("ids", "text"), default=None)
    wl.add_arguments(parser)


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    from pdserve.bench import sched_report

    ns = args
    ns.output_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result: dict[str, Any] = {
        "command": report.command_line(argv),
        "machine": report.host(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t0)),
        "experiments": [],
    }
    path = ns.output_dir / "results.json"
    for name in ns.experiment:
        result["experiments"].append(run_experiment(ns, EXPERIMENTS[name]))
        result["wall_s"] = time.time() - t0
        report.write_json(path, result, indent=1)
    text = sched_report.build_report(result)
    (ns.output_dir / "report.md").write_text(text)
    print(text)
    ok = any("summary" in a for e in result["experiments"] for a in e.get("arms", []))
    return 0 if ok else 1
