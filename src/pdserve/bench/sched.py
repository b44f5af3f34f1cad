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
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdserve import argtypes
from pdserve.bench import compare
from pdserve.bench.load import serve_bench, summary
from pdserve.bench.observe import (
    WorkerPoller,
    fetch_timelines,
    get,
    metrics_delta,
    scrape_metrics,
)
from pdserve.bench.sched_stats import summarize_arm
from pdserve.workloads import streams as wl
from pdserve.workloads.spec import LoadSpec, default
from pdserve.workloads.streams import RequestItem

WARMUP_TOKENS = 4
HEALTH_WAIT_S = 60.0


# ---------------------------------------------------------------------------- experiments


@dataclass(frozen=True)
class Arm:
    name: str
    flags: tuple[str, ...]


@dataclass(frozen=True)
class Experiment:
    name: str
    workload: str
    prefill: int
    decode: int
    arms: tuple[Arm, Arm]  # A: the feature, B: the baseline
    load_factor: float  # x the measured capacity
    num_requests: int
    # bench serve settings of the workload (input_len, output_len, ...), unless given as flags
    settings: dict[str, Any] = field(default_factory=dict)


EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        Experiment(
            "admission",
            "synthetic",
            1,
            1,
            (Arm("admission", ()), Arm("no-admission", ("--no-admission",))),
            load_factor=2.0,
            num_requests=40,
            settings={"input_len": 512, "output_len": 64, "len_spread": 0.25},
        ),
        Experiment(
            "conditional",
            "mixed",
            1,
            1,
            (
                Arm("conditional", ("--disaggregation", "conditional")),
                Arm("always", ("--disaggregation", "always")),
            ),
            load_factor=1.0,
            num_requests=40,
        ),
        Experiment(
            "prefix",
            "multiturn",
            2,
            2,
            (
                Arm("prefix-routing", ("--prefix-routing",)),
                Arm("no-prefix", ("--no-prefix-routing",)),
            ),
            load_factor=1.0,
            num_requests=32,
            settings={
                "input_len": 256,
                "output_len": 32,
                "len_spread": 0.25,
                "turns": 4,
                "prompt_format": "text",
            },
        ),
        Experiment(
            "autobalance",
            "shifting",
            1,
            1,
            (Arm("autobalance", ("--autobalance",)), Arm("static", ())),
            load_factor=1.0,
            num_requests=40,
        ),
    )
}
# the bench serve settings each workload reads (generic flags and its own, WORKLOAD_ARGUMENTS)
_LENGTHS = ("input_len", "output_len", "len_spread")
WORKLOAD_KEYS: dict[str, tuple[str, ...]] = {
    "synthetic": (*_LENGTHS, "prompt_format"),
    "multiturn": (*_LENGTHS, "turns", "prompt_format", "multiturn_answers"),
    "mixed": ("short_len", "long_len", "long_fraction", "mixed_output_len", "prompt_format"),
    "shifting": (
        "phase1_input_len",
        "phase1_output_len",
        "phase2_input_len",
        "phase2_output_len",
        "shift_at",
        "shift_at_s",
        "prompt_format",
    ),
}


def topology(exp: Experiment, args: argparse.Namespace) -> tuple[int, int]:
    return (args.prefill or exp.prefill, args.decode or exp.decode)


def server_command(
    args: argparse.Namespace,
    exp: Experiment,
    port: int | str,
    arm: Arm | None,
    slo: tuple[float, float] | None,
) -> list[str]:
    """`pdserve serve` of one arm (`arm=None`, `slo=None`: the plain calibration server)."""
    p, d = topology(exp, args)
    cmd = [
        compare._pdserve_bin(), "serve", *([str(args.model)] if args.model else []),
        "--prefill", str(p), "--decode", str(d), "--threads", str(args.threads),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if slo is not None and (args.server_slos or exp.name == "admission"):
        cmd += ["--slo-ttft", f"{slo[0]:.6g}", "--slo-tpot", f"{slo[1]:.6g}"]
        if exp.name != "admission":
            cmd.append("--no-admission")
    if arm is not None:
        cmd += list(arm.flags)
    return cmd + shlex.split(args.pdserve_args)


def _system(
    args: argparse.Namespace,
    exp: Experiment,
    label: str,
    arm: Arm | None,
    slo: tuple[float, float] | None,
) -> compare.System:
    def command(_: argparse.Namespace, port: int) -> list[str]:
        return server_command(args, exp, port, arm, slo)

    def missing(_: argparse.Namespace) -> str | None:
        return None

    return compare.System(f"{exp.name}-{label}", "pdserve", command, missing, timelines=True)


@contextlib.contextmanager
def server(system: compare.System, args: argparse.Namespace) -> Iterator[str]:
    """compare.running_server (free port, /v1/models, stop), then /health "ok"."""
    log = args.output_dir / "logs" / f"{system.name}.log"
    with compare.running_server(system, args, log) as url:
        wait_healthy(url, HEALTH_WAIT_S)
        yield url


def wait_healthy(url: str, timeout: float) -> bool:
    """Until GET /health says "ok" (True), or `timeout` passed (False: run anyway)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            resp = httpx.get(f"{url}/health", timeout=2.0)
            if resp.status_code == 200 and resp.json().get("status") == "ok":
                return True
        time.sleep(0.5)
    return False


# ---------------------------------------------------------------------------- bench serve runs


class _Items:
    def __init__(self, name: str, items: list[RequestItem]) -> None:
        self.name, self.items = name, items

    def __iter__(self) -> Iterator[RequestItem]:
        return iter(self.items)


def settings(args: argparse.Namespace, exp: Experiment) -> dict[str, Any]:
    """The workload's bench serve settings: flags given here, else the experiment's defaults
    (else bench serve's); only those its workload reads."""
    out: dict[str, Any] = {"workload": exp.workload}
    for key in WORKLOAD_KEYS[exp.workload]:
        given = getattr(args, key, None)
        out[key] = given if given is not None else exp.settings.get(key)
    return {k: v for k, v in out.items() if v is not None}


def bench_ns(
    args: argparse.Namespace,
    exp: Experiment,
    url: str,
    *,
    num_requests: int,
    seed: int,
    rate: float | None = None,
    concurrency: int | None = None,
    slo: tuple[float, float] | None = None,
) -> LoadSpec:
    """The load of one arm's run, with the experiment's workload settings."""
    spec = LoadSpec(
        url=url,
        workload=exp.workload,
        num_requests=num_requests,
        seed=seed,
        backend="pdserve",
        timeout=args.timeout,
        no_progress=True,
        rate=rate,
        burstiness=args.burstiness if rate is not None else default("burstiness"),
        concurrency=None if rate is not None else (concurrency or 1),
        tokenizer=str(args.model) if args.model else None,
        slo_ttft=slo[0] if slo is not None else None,
        slo_tpot=slo[1] if slo is not None else None,
    )
    return spec.but(**{k: v for k, v in settings(args, exp).items() if k != "workload"})


def calibration_items(workload: Any, k: int) -> list[RequestItem]:
    """`k` independent requests spanning the workload's prompt lengths (shortest, longest, evenly
    between by rank): multi-turn items become single requests of their placeholder prompt."""
    items = sorted(workload, key=lambda it: (len(it.prompt), it.max_tokens))
    if not items:
        return []
    picks = sorted({round(x) for x in np.linspace(0, len(items) - 1, num=min(k, len(items)))})
    return [
        RequestItem(items[i].prompt, items[i].max_tokens, conversation=j, phase=items[i].phase)
        for j, i in enumerate(picks)
    ]


def warm_up(args: argparse.Namespace, exp: Experiment, url: str) -> None:
    """One short request (rejected or failed is fine: the run will show it)."""
    ns = bench_ns(args, exp, url, num_requests=1, seed=args.seed + 999).but(
        workload="synthetic",
        input_len=16,
        output_len=WARMUP_TOKENS,
        len_spread=0.0,
        prompt_format="text",
    )
    with contextlib.suppress(httpx.HTTPError, ValueError):
        asyncio.run(serve_bench.run_benchmark(ns))


def calibrate(args: argparse.Namespace, exp: Experiment) -> dict[str, Any]:
    """SLOs and the load rate: given, or measured on a plain server (see the module doc)."""
    out: dict[str, Any] = {}
    need_slo = args.slo_ttft is None or args.slo_tpot is None
    need_rate = args.rate is None
    p, d = topology(exp, args)
    conc = args.capacity_concurrency or 2 * (p + d)
    if need_slo or need_rate:
        out["command"] = shlex.join(server_command(args, exp, "PORT", None, None))
        with server(_system(args, exp, "calibration", None, None), args) as url:
            warm_up(args, exp, url)
            if need_slo:
                n = args.calibration_requests
                ns = bench_ns(args, exp, url, num_requests=n, seed=args.seed + 1)
                items = calibration_items(serve_bench.make_workload(_wider(ns)), ns.num_requests)
                ns = ns.but(num_requests=len(items))
                res = asyncio.run(serve_bench.run_benchmark(ns, _Items(exp.workload, items)))
                out["unloaded"] = res
            if need_rate:
                n = args.capacity_requests or 3 * conc
                ns = bench_ns(args, exp, url, num_requests=n, seed=args.seed + 2, concurrency=conc)
                res = asyncio.run(serve_bench.run_benchmark(ns))
                out["capacity_run"] = res
    ttft_s = tpot_s = None
    how: list[str] = []
    if need_slo:
        reqs = [r for r in out["unloaded"]["requests"] if r.get("error") is None]
        ttfts = [r["ttft_ms"] for r in reqs if r.get("ttft_ms") is not None]
        tpots = [r["tpot_ms"] for r in reqs if r.get("tpot_ms") is not None]
        if not ttfts or not tpots:
            raise RuntimeError(f"calibration: no unloaded latencies ({out['unloaded']['errors']})")
        ttft_s, tpot_s = (
            args.slo_ttft_factor * max(ttfts) / 1e3,
            args.slo_tpot_factor * max(tpots) / 1e3,
        )
        how.append(
            f"{args.slo_ttft_factor:g} x the slowest unloaded TTFT ({max(ttfts):.0f} ms) and "
            f"{args.slo_tpot_factor:g} x the slowest unloaded TPOT ({max(tpots):.1f} ms) of "
            f"{len(reqs)} requests spanning the prompt lengths, one at a time"
        )
    slo_ttft = args.slo_ttft if args.slo_ttft is not None else ttft_s
    slo_tpot = args.slo_tpot if args.slo_tpot is not None else tpot_s
    if not need_slo:
        how.append("given on the command line")
    assert slo_ttft is not None and slo_tpot is not None
    out["slo"] = {"ttft_s": slo_ttft, "tpot_s": slo_tpot, "how": "; ".join(how)}
    if need_rate:
        cap = out["capacity_run"]
        capacity = cap["completed"] / max(cap["duration_s"], 1e-9)
        if not capacity > 0:
            raise RuntimeError(f"calibration: nothing completed at capacity ({cap['errors']})")
        factor = load_factor(args, exp)
        rate = factor * capacity
        out["capacity_rps"] = capacity
        out["rate_how"] = (
            f"{factor:g} x capacity {capacity:.3f} req/s (closed loop, "
            f"concurrency {conc}, {cap['config']['num_requests']} requests)"
        )
    else:
        rate = args.rate
        out["rate_how"] = "given on the command line"
    out["rate"] = rate
    return out


def _wider(ns: LoadSpec) -> LoadSpec:
    """The calibration pool: enough items of the workload to span its lengths."""
    # by index (shift_at*: None): both phases in the pool
    return ns.but(num_requests=max(20, 5 * ns.num_requests), shift_at_s=None, shift_at=None)


def load_factor(args: argparse.Namespace, exp: Experiment) -> float:
    return float(args.load_factor) if args.load_factor is not None else exp.load_factor


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
                res = asyncio.run(serve_bench.run_benchmark(ns))
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


def _experiments(text: str) -> list[str]:
    if text == "all":
        return list(EXPERIMENTS)
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown experiments {unknown}; known: {', '.join(EXPERIMENTS)}, all"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pos_int, pos_float = argtypes.positive_int, argtypes.positive_float
    parser.add_argument(
        "--experiment",
        type=_experiments,
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
    command = "pdserve " + shlex.join(argv if argv is not None else sys.argv[1:])
    result: dict[str, Any] = {
        "command": command,
        "machine": {**compare.machine(), "load_average": list(os.getloadavg())},
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t0)),
        "experiments": [],
    }
    path = ns.output_dir / "results.json"
    for name in ns.experiment:
        result["experiments"].append(run_experiment(ns, EXPERIMENTS[name]))
        result["wall_s"] = time.time() - t0
        path.write_text(json.dumps(summary.json_safe(result), indent=1) + "\n")
    report = sched_report.build_report(result)
    (ns.output_dir / "report.md").write_text(report)
    print(report)
    ok = any("summary" in a for e in result["experiments"] for a in e.get("arms", []))
    return 0 if ok else 1
