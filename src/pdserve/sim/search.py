"""`pdserve plan --simulate`: the most goodput per GPU at >= 90% SLO attainment, by simulation.

Method (DistServe's, in two stages, so a 1000-GPU plan costs what a replica set costs):

1. Screen analytically. For each tensor-parallel degree that fits the model (1, 2, 4, 8), fit
   the router's `CostModel` to the roofline step model (`planner_cost_model`) and use
   `pdserve plan`'s queueing formulas: a P instance's rate at the TTFT SLO, a D instance's
   rate and batch at the TPOT SLO and its KV memory, a colocated instance's rate at both.
   Every disaggregated replica set nP x TP_p + nD x TP_d (nP, nD <= 8, at most 16 GPUs) and
   every colocated TP is ranked by goodput per GPU.
2. Simulate the finalists: the best two disaggregated sets and the best colocated TP at two
   chunk sizes. For each, bisect the replica set's arrival rate (Poisson) for the highest one
   at which the simulated attainment (both SLOs, per request, over all requests) is >= 90%,
   each run `requests_per_run` requests long; the batch cap of D is the analytic batch,
   P's chunk is the whole prompt.
3. Scale: replicas = GPUs // the set's GPUs; the cluster's goodput = replicas x the set's.
   Requests are spread evenly over replicas (a router per replica set, or a global one that
   balances), so one replica set at 1/replicas of the traffic is the cluster's behaviour.

The bottleneck named is the one the simulation shows just past the best rate: the SLO that
fails first, and for disaggregation the pool the analytic capacities say binds.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace
from typing import Any

from pdserve.costmodel import capacity
from pdserve.costmodel import plan as analytic
from pdserve.sim import hardware
from pdserve.sim.deploy import DEFAULT_LINK_GBPS_GPU, Deployment, simulate
from pdserve.sim.steptime import Link, RooflineStep, gbps_to_bytes_s, planner_cost_model
from pdserve.sim.workload import arrivals, make_items, requests_from_items

TARGET = 0.9
TPS = (1, 2, 4, 8)
MAX_SET_GPUS = 16


@dataclass(frozen=True)
class Finalist:
    deployment: Deployment
    estimate_rps: float  # the analytic rate of the replica set
    note: str


@dataclass
class RoleCaps:
    tp: int
    prefill: capacity.PrefillCapacity
    decode: capacity.DecodeCapacity
    colocated: capacity.ColocatedCapacity


def role_capacities(
    hw: str, model: str, shape: capacity.Shape, slo: capacity.SLO, link_gbps: float
) -> list[RoleCaps]:
    g, ms = hardware.gpu(hw), hardware.model_shape(model)
    out = []
    for tp in TPS:
        try:
            step = RooflineStep(g, ms, tp)
        except ValueError:
            continue  # does not fit, or the heads do not split
        link = Link(gbps_to_bytes_s(link_gbps) * tp)
        cm = planner_cost_model(step, link=link)
        kv = step.kv_tokens()
        bpt = ms.kv_bytes_per_token
        out.append(
            RoleCaps(
                tp,
                capacity.prefill_capacity(cm, shape, slo.ttft_s),
                capacity.decode_capacity(
                    cm, shape, slo.tpot_s, max_kv_tokens=kv, kv_bytes_per_token=bpt
                ),
                capacity.colocated_capacity(cm, shape, slo, max_kv_tokens=kv),
            )
        )
    if not out:
        raise ValueError(f"{model} does not fit on up to {TPS[-1]} x {g.name}")
    return out


def finalists(caps: list[RoleCaps], base: Deployment, input_len: int) -> list[Finalist]:
    split: list[tuple[float, Finalist]] = []
    for p in caps:
        for d in caps:
            if p.prefill.rate <= 0 or d.decode.rate <= 0:
                continue
            for n_p in range(1, 9):
                for n_d in range(1, 9):
                    set_gpus = n_p * p.tp + n_d * d.tp
                    if set_gpus > MAX_SET_GPUS:
                        continue
                    rate = min(n_p * p.prefill.rate, n_d * d.decode.rate)
                    dep = replace(
                        base,
                        prefill=n_p,
                        decode=n_d,
                        colocated=0,
                        tp_prefill=p.tp,
                        tp_decode=d.tp,
                        max_num_seqs=max(1, d.decode.batch),
                        prefill_batched_tokens=max(2048, input_len * 2),
                    )
                    bound = "prefill" if n_p * p.prefill.rate < n_d * d.decode.rate else "decode"
                    split.append(
                        (rate / set_gpus, Finalist(dep, rate, f"analytic screen: {bound}-bound"))
                    )
    # the smallest replica set within 3% of the best: the cheapest one to simulate, and one
    # that scales to any cluster size with the least rounding; then the best other TP pair
    split.sort(key=lambda x: -x[0])
    picked: list[Finalist] = []
    for tps in _tp_pairs_by_rank(split):
        top = max(g for g, f in split if _tps(f) == tps)
        near = [f for g, f in split if _tps(f) == tps and g >= 0.97 * top]
        picked.append(min(near, key=lambda f: f.deployment.gpus))
        if len(picked) == 2:
            break
    coloc = [c for c in caps if c.colocated.rate > 0]
    if coloc:
        best = max(coloc, key=lambda c: c.colocated.rate / c.tp)
        for chunk in (512, 2048):
            dep = replace(
                base, prefill=0, decode=0, colocated=1, tp_decode=best.tp, max_batched_tokens=chunk
            )
            picked.append(
                Finalist(dep, best.colocated.rate, f"analytic screen: {best.colocated.limit}-bound")
            )
    return picked


def _tps(f: Finalist) -> tuple[int, int]:
    return f.deployment.tp_prefill, f.deployment.tp_decode


def _tp_pairs_by_rank(split: list[tuple[float, Finalist]]) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    for _, f in split:
        if _tps(f) not in seen:
            seen.append(_tps(f))
    return seen


def attainment_at(d: Deployment, args: argparse.Namespace, rate: float, n: int) -> dict[str, Any]:
    ns = argparse.Namespace(**vars(args))
    # long enough for the batch to fill: two request lifetimes of arrivals (bounded); the first
    # lifetime's requests see a filling system and are left out of the attainment
    life = args.slo_ttft + args.output_len * args.slo_tpot
    ns.num_requests = max(n, min(4 * n, math.ceil(rate * 2 * life)))
    items = make_items(ns)
    reqs = requests_from_items(items, arrivals(len(items), rate, args.seed, args.arrival_cv))
    return simulate(d, reqs, warmup_s=min(life, reqs[-1].arrival / 2))


def best_rate(
    f: Finalist, args: argparse.Namespace, n: int, steps: int
) -> tuple[float, dict[str, Any] | None, int]:
    """Highest rate (bisection around the analytic estimate) with attainment >= TARGET."""
    lo, hi = 0.0, max(f.estimate_rps, 1e-3) * 1.6
    best: dict[str, Any] | None = None
    runs = 0
    rate = max(f.estimate_rps, 1e-3)
    for _ in range(steps):
        s = attainment_at(f.deployment, args, rate, n)
        runs += 1
        if s["attainment"] >= TARGET:
            lo, best = rate, s
        else:
            hi = rate
        rate = (lo + hi) / 2
    return lo, best, runs


def plan_simulated(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    hw = args.hardware.lower()
    if hw == "cpu":
        raise ValueError("plan --simulate sizes GPU deployments: use --hardware a100|h100|h200")
    hardware.gpu(hw)
    model = args.model or "llama-3.1-8b"
    cached = (
        analytic.default_cached_len(args.workload, args.input_len)
        if args.workload in analytic.WORKLOADS
        else 0
    )
    shape = capacity.Shape(args.input_len, max(2, args.output_len), cached)
    slo = capacity.SLO(args.slo_ttft, args.slo_tpot)
    link = args.link_gbps or DEFAULT_LINK_GBPS_GPU
    caps = role_capacities(hw, model, shape, slo, link)
    base = Deployment(
        hardware=hw,
        model=model,
        link_gbps=link,
        slo_ttft_s=slo.ttft_s,
        slo_tpot_s=slo.tpot_s,
        expected_output=args.output_len,
    )
    n = max(60, min(200, 20000 // max(1, args.output_len)))
    results: list[dict[str, Any]] = []
    runs = 0
    for f in finalists(caps, base, args.input_len):
        rate, summary, k = best_rate(f, args, n, args.search_steps)
        runs += k
        per_gpu = rate / f.deployment.gpus
        results.append({"finalist": f, "rate": rate, "per_gpu": per_gpu, "summary": summary})
    results.sort(key=lambda r: -r["per_gpu"])
    best = results[0] if results and results[0]["per_gpu"] > 0 else None
    out: dict[str, Any] = {
        "hardware": hardware.gpu(hw).name,
        "model": model,
        "gpus": args.gpus,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": TARGET},
        "workload": {
            "name": args.workload,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "requests_per_run": n,
        },
        "analytic": [
            {
                "tp": c.tp,
                "prefill_rps_per_gpu": c.prefill.rate / c.tp,
                "decode_rps_per_gpu": c.decode.rate / c.tp,
                "decode_batch": c.decode.batch,
                "colocated_rps_per_gpu": c.colocated.rate / c.tp,
            }
            for c in caps
        ],
        "candidates": [
            {
                "deployment": r["finalist"].deployment.label(),
                "chunk": r["finalist"].deployment.max_batched_tokens,
                "batch_cap": r["finalist"].deployment.max_num_seqs,
                "set_gpus": r["finalist"].deployment.gpus,
                "rate_rps": r["rate"],
                "goodput_per_gpu": r["per_gpu"],
                "analytic_rps": r["finalist"].estimate_rps,
                "note": r["finalist"].note,
            }
            for r in results
        ],
        "simulations": runs,
    }
    if best is None:
        out["recommended"] = None
        out["why"] = "no plan meets these SLOs: " + "; ".join(
            f"TP{c.tp}: {c.prefill.reason if c.prefill.rate <= 0 else c.decode.reason}"
            for c in caps
        )
    else:
        d: Deployment = best["finalist"].deployment
        replicas = args.gpus // d.gpus
        out["recommended"] = {
            "replica_set": d.label(),
            "set_gpus": d.gpus,
            "replicas": replicas,
            "gpus_used": replicas * d.gpus,
            "chunk": d.max_batched_tokens,
            "batch_cap": d.max_num_seqs,
            "goodput_per_gpu": best["per_gpu"],
            "cluster_goodput_rps": best["rate"] * replicas,
        }
        out["bottleneck"] = bottleneck(best, args, n)
        if replicas == 0:
            out["why"] = f"{args.gpus} GPUs are fewer than one replica set ({d.gpus})"
    out["wall_s"] = time.perf_counter() - t0
    return out


def bottleneck(best: dict[str, Any], args: argparse.Namespace, n: int) -> str:
    """What fails first just past the best rate (simulated at 1.25x)."""
    f: Finalist = best["finalist"]
    s = attainment_at(f.deployment, args, max(best["rate"], 1e-3) * 1.25, n)
    ttft, tpot = s["ttft_attainment"], s["tpot_attainment"]
    what = "TTFT (prefill queueing)" if ttft < tpot else "TPOT (decode batching)"
    util = ", ".join(f"{k} busy {v:.0%}" for k, v in s["utilization"].items())
    return (
        f"at 1.25x the best rate, {what} fails first (TTFT met {ttft:.0%}, TPOT met {tpot:.0%}; "
        f"{util}); {f.note}"
    )


def render(out: dict[str, Any]) -> str:
    lines = [
        f"plan (simulated): {out['model']} on {out['hardware']}, {out['gpus']} GPUs, "
        f"SLO TTFT {out['slo']['ttft_s']} s / TPOT {out['slo']['tpot_s']} s at "
        f">= {TARGET:.0%} attainment",
        "",
        "| replica set | chunk | batch cap | GPUs | best req/s | goodput/GPU | analytic req/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in out["candidates"]:
        lines.append(
            f"| {c['deployment']} | {c['chunk']} | {c['batch_cap']} | {c['set_gpus']} | "
            f"{c['rate_rps']:.2f} | {c['goodput_per_gpu']:.3f} | {c['analytic_rps']:.2f} |"
        )
    rec = out["recommended"]
    lines.append("")
    if rec is None:
        lines.append(out["why"])
    else:
        lines += [
            f"recommended: {rec['replicas']} x [{rec['replica_set']}] = {rec['gpus_used']} GPUs, "
            f"{rec['cluster_goodput_rps']:.1f} req/s within the SLOs "
            f"({rec['goodput_per_gpu']:.3f} per GPU)",
            f"bottleneck: {out['bottleneck']}",
        ]
        if out.get("why"):
            lines.append(out["why"])
    lines.append(
        f"({out['simulations']} simulations of {out['workload']['requests_per_run']} "
        f"requests, {out['wall_s']:.1f} s wall)"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pdserve plan`'s flags for --simulate (the workload and SLO flags are plan's own)."""
    g = parser.add_argument_group("simulated planning (--simulate)")
    g.add_argument(
        "--simulate",
        action="store_true",
        help="size a GPU cluster by simulation (see pdserve.sim.search)",
    )
    g.add_argument("--hardware", default="h100", help="a100 | h100 | h200")
    g.add_argument("--gpus", type=int, default=8, help="GPUs to plan for")
    g.add_argument("--link-gbps", type=float, default=None, help="P->D Gbit/s per GPU (400)")
    g.add_argument("--search-steps", type=int, default=3, help="bisection steps per finalist")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--len-spread", type=float, default=0.0)
    g.add_argument("--arrival-cv", type=float, default=1.0)
    g.add_argument("--turns", type=int, default=3)


def run(args: argparse.Namespace) -> int:
    if args.search_steps < 1:
        raise ValueError("--search-steps must be >= 1")
    if args.link_gbps is not None and not args.link_gbps > 0:
        raise ValueError("--link-gbps must be > 0")
    if args.gpus < 1:
        raise ValueError("--gpus must be >= 1")
    out = plan_simulated(args)
    print(json.dumps(_jsonable(out), indent=1) if args.json else render(out))
    return 0 if out["recommended"] is not None else 1


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
