"""The SLOs and the load rate of a `bench sched` experiment, when not given: measured on the
plain server of its topology (see `sched`'s module docstring, "SLOs and load").

`measure` runs the unloaded requests (spread over the workload's prompt lengths, one at a time)
and the closed-loop capacity run against that server; `decide` turns them, or the flags given,
into the SLOs and the rate, each with how it was chosen.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import numpy as np

from pdserve.bench.harness.servers import run_load
from pdserve.bench.load import serve_bench
from pdserve.bench.sched_experiments import Experiment, bench_ns, load_factor, topology
from pdserve.workloads.spec import LoadSpec
from pdserve.workloads.streams import RequestItem


def needs(args: argparse.Namespace) -> tuple[bool, bool]:
    """(the SLOs must be measured, the rate must be measured)."""
    return args.slo_ttft is None or args.slo_tpot is None, args.rate is None


def concurrency(args: argparse.Namespace, exp: Experiment) -> int:
    """In flight during the capacity run: `--capacity-concurrency`, else 2 x the workers."""
    p, d = topology(exp, args)
    return int(args.capacity_concurrency or 2 * (p + d))


class _Items:
    def __init__(self, name: str, items: list[RequestItem]) -> None:
        self.name, self.items = name, items

    def __iter__(self) -> Iterator[RequestItem]:
        return iter(self.items)


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


def measure(args: argparse.Namespace, exp: Experiment, url: str) -> dict[str, Any]:
    """The runs on the plain server at `url` that `needs` asks for: "unloaded" (for the SLOs),
    "capacity_run" (for the rate)."""
    out: dict[str, Any] = {}
    need_slo, need_rate = needs(args)
    if need_slo:
        n = args.calibration_requests
        ns = bench_ns(args, exp, url, num_requests=n, seed=args.seed + 1)
        items = calibration_items(serve_bench.make_workload(_wider(ns)), ns.num_requests)
        ns = ns.but(num_requests=len(items))
        out["unloaded"] = run_load(ns, _Items(exp.workload, items))
    if need_rate:
        conc = concurrency(args, exp)
        n = args.capacity_requests or 3 * conc
        ns = bench_ns(args, exp, url, num_requests=n, seed=args.seed + 2, concurrency=conc)
        out["capacity_run"] = run_load(ns)
    return out


def decide(args: argparse.Namespace, exp: Experiment, out: dict[str, Any]) -> dict[str, Any]:
    """`out` (the runs of `measure`) with "slo" and "rate" added, each with how it was chosen
    ("how", "rate_how"), and "capacity_rps" when measured."""
    need_slo, need_rate = needs(args)
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
            f"{factor:g} x capacity {capacity:.3f} req/s (closed loop, concurrency "
            f"{concurrency(args, exp)}, {cap['config']['num_requests']} requests)"
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
