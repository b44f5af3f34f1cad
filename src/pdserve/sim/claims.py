"""The seeds' qualitative claims, on simulated H100s (docs/benchmarks/sim.md, plots beside it).

    python -m pdserve.sim.claims --out docs/benchmarks/sim

Llama-3.1-8B, TP1 per worker, 400 Gbit/s RDMA per GPU unless said. Each experiment sweeps the
arrival rate (Poisson) and records SLO attainment; goodput per GPU = the highest rate per GPU
with attainment >= 90% (DistServe's metric), read off the sweep (the last rate before it drops
below, so it is as coarse as the sweep's grid).

1. knowledge base (2000-token context, 300-token answer), tight TPOT: 1P1D vs 2 colocated;
2. short prompts (200 in, 300 out): the same pair;
3. the KB case over 25 Gbit/s Ethernet vs 400 Gbit/s RDMA;
4. the best P:D ratio as input and output lengths move (4 to 8 GPUs per replica set);
5. overload: admission (early rejection) and conditional disaggregation on and off.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.sim.deploy import Deployment, simulate
from pdserve.sim.workload import arrivals, make_items, requests_from_items

TARGET = 0.9


def requests(workload: str, n: int, input_len: int, output_len: int, rate: float, seed: int = 0):  # type: ignore[no-untyped-def]
    ns = argparse.Namespace(
        workload=workload,
        num_requests=n,
        input_len=input_len,
        output_len=output_len,
        len_spread=0.1,
        seed=seed,
        turns=3,
    )
    items = make_items(ns)
    return requests_from_items(items, arrivals(len(items), rate, seed))


def sweep(
    d: Deployment, workload: str, input_len: int, output_len: int, rates: list[float], n: int
) -> list[dict[str, Any]]:
    rows = []
    for rate in rates:
        s = steady(d, workload, input_len, output_len, rate, n)
        rows.append(
            {
                "rate": rate,
                "rate_per_gpu": rate / d.gpus,
                "attainment": s["attainment"],
                "ttft_p90": s["ttft_s"]["p90"],
                "tpot_p90": s["tpot_s"]["p90"],
                "rejected": s["rejected"],
                "goodput_per_gpu": s["goodput_per_gpu"],
                "routes": s["routes"],
                "requests": s["requests"],
            }
        )
        print(
            d.label(), workload, input_len, output_len, rate, f"{s['attainment']:.2f}", flush=True
        )
    return rows


def steady(
    d: Deployment, workload: str, input_len: int, output_len: int, rate: float, n: int
) -> dict[str, Any]:
    """A run long enough for the batch to fill: arrivals over >= 2.5 request lifetimes (at
    the SLOs), at most 4n requests; the first lifetime's requests are not counted."""
    life = (d.slo_ttft_s or 1.0) + max(output_len, 40) * (d.slo_tpot_s or 0.05)
    count = min(4 * n, max(n, math.ceil(rate * 2.5 * life)))
    reqs = requests(workload, count, input_len, output_len, rate)
    return simulate(d, reqs, warmup_s=min(life, reqs[-1].arrival / 3))


def goodput_per_gpu(rows: list[dict[str, Any]]) -> float:
    best = 0.0
    for r in rows:
        if r["attainment"] < TARGET:
            break
        best = r["rate_per_gpu"]
    return best


def plot(path: Path, title: str, curves: dict[str, list[dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in curves.items():
        ax.plot(
            [r["rate_per_gpu"] for r in rows],
            [100 * r["attainment"] for r in rows],
            marker="o",
            label=label,
        )
    ax.axhline(100 * TARGET, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("arrival rate per GPU (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pd_vs_colocated(
    out: Path,
    name: str,
    input_len: int,
    output_len: int,
    slo: tuple[float, float],
    rates_per_gpu: list[float],
    n: int,
    links: dict[str, float] | None = None,
) -> dict[str, Any]:
    base = Deployment(
        hardware="h100",
        model="llama-3.1-8b",
        slo_ttft_s=slo[0],
        slo_tpot_s=slo[1],
        expected_output=output_len,
    )
    configs = {"3 colocated": replace(base, prefill=0, decode=0, colocated=3)}
    for label, gbps in (links or {"1P2D": 400.0}).items():
        configs[label] = replace(base, prefill=1, decode=2, link_gbps=gbps)
    curves = {
        label: sweep(d, "synthetic", input_len, output_len, [r * d.gpus for r in rates_per_gpu], n)
        for label, d in configs.items()
    }
    plot(
        out / f"{name}.png",
        f"{name}: Llama-3.1-8B on H100, {input_len} in / {output_len} "
        f"out, SLO TTFT {slo[0]} s, TPOT {slo[1] * 1e3:g} ms",
        curves,
    )
    return {
        "input_len": input_len,
        "output_len": output_len,
        "slo": slo,
        "goodput_per_gpu": {k: goodput_per_gpu(v) for k, v in curves.items()},
        "curves": curves,
    }


def best_ratio(input_len: int, output_len: int, slo: tuple[float, float], n: int) -> dict:
    """Simulated goodput per GPU of nP:nD in 1:3 .. 3:1 (4 GPUs), the best one named."""
    base = Deployment(
        hardware="h100",
        model="llama-3.1-8b",
        slo_ttft_s=slo[0],
        slo_tpot_s=slo[1],
        expected_output=output_len,
    )
    out = {}
    for n_p, n_d in ((1, 2), (1, 1), (2, 1)):
        d = replace(base, prefill=n_p, decode=n_d)
        # bisection on the rate of the set for attainment >= 90%
        lo, hi = 0.0, 8.0 * d.gpus
        while steady(d, "synthetic", input_len, output_len, hi, n)["attainment"] >= TARGET:
            lo, hi = hi, 2 * hi  # the bracket's top must fail
        for _ in range(4):
            mid = (lo + hi) / 2
            s = steady(d, "synthetic", input_len, output_len, mid, n)
            lo, hi = (mid, hi) if s["attainment"] >= TARGET else (lo, mid)
        out[f"{n_p}:{n_d}"] = lo / d.gpus
        print("ratio", input_len, output_len, n_p, n_d, lo / d.gpus, flush=True)
    return {
        "input_len": input_len,
        "output_len": output_len,
        "per_gpu": out,
        "best": max(out, key=lambda k: out[k]),
    }


def scheduling(out: Path, n: int, which: set[str] | None = None) -> dict[str, Any]:
    """Overload a 1P1D set: admission on/off (KB case), conditional vs always (mixed)."""
    slo = (1.0, 0.04)
    base = Deployment(
        hardware="h100",
        model="llama-3.1-8b",
        prefill=1,
        decode=1,
        slo_ttft_s=slo[0],
        slo_tpot_s=slo[1],
        expected_output=300,
    )
    arms = {
        "round robin": base,
        "planner": replace(base, planner=True),
        "planner + admission": replace(base, planner=True, admission=True),
    }
    rates = [8.0, 16.0, 24.0, 32.0]
    res: dict[str, Any] = {}
    if which is None or "sched" in which:
        adm = {k: sweep(d, "synthetic", 2000, 300, rates, n) for k, d in arms.items()}
        plot(out / "admission.png", "1P1D, 2000 in / 300 out: early rejection under overload", adm)
        res["admission"] = adm
    if which is not None and "cond" not in which:
        return res
    mixed_arms = {
        "always": replace(base, planner=True, expected_output=40),
        "conditional": replace(
            base, planner=True, disaggregation="conditional", expected_output=40
        ),
    }
    rates_mixed = [40.0, 80.0, 120.0, 160.0, 200.0]
    mix = {k: sweep(d, "mixed", 0, 0, rates_mixed, n) for k, d in mixed_arms.items()}
    plot(out / "conditional.png", "1P1D, mixed (75% 64-200 / 25% 1500-2000 in, 16-64 out)", mix)
    res["conditional"] = mix
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n", type=int, default=200, help="requests per simulation")
    p.add_argument("--only", default=None)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    only = set(args.only.split(",")) if args.only else None
    res: dict[str, Any] = {}
    grid = [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0]
    slo = (1.0, 0.012)  # tight: 1.3x a lone decode step of the 8B model on an H100
    if not only or "kb" in only:
        res["kb"] = pd_vs_colocated(args.out, "kb", 2000, 300, slo, grid, args.n)
    if not only or "short" in only:
        res["short"] = pd_vs_colocated(
            args.out, "short", 200, 100, slo, [70.0, 80.0, 90.0, 100.0, 110.0, 120.0], 2 * args.n
        )
    if not only or "link" in only:
        res["link"] = pd_vs_colocated(
            args.out,
            "link",
            2000,
            300,
            slo,
            grid,
            args.n,
            links={"1P2D 400G RDMA": 400.0, "1P2D 25G Ethernet": 25.0},
        )
    if not only or "ratio" in only:
        res["ratio"] = [
            best_ratio(i, o, (1.0, 0.015), args.n)
            for i, o in ((500, 300), (2000, 300), (2000, 100))
        ]
    if not only or "sched" in only or "cond" in only:
        res["scheduling"] = scheduling(args.out, args.n, only)
    res["wall_s"] = time.perf_counter() - t0
    res["load_avg"] = os.getloadavg()
    (args.out / f"claims-{'-'.join(sorted(only)) if only else 'all'}.json").write_text(
        json.dumps(res, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
