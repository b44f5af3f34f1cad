"""`pdserve plan` on the command line: load the cost models (one per thread count), run
`plan.make_plan`, print the table (`render_text`) or JSON (`plan_json`). The model itself —
shapes, SLOs, queueing, capacities, candidates — is `costmodel/capacity.py` and `plan.py`."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdserve import argtypes
from pdserve.costmodel.capacity import DEFAULT_EFFICIENCY, SLO, Shape, speedup, worker_model
from pdserve.costmodel.model import CostModel
from pdserve.costmodel.plan import WORKLOADS, Candidate, Plan, default_cached_len, make_plan

# --------------------------------------------------------------------------- output


def render_text(plan: Plan, top: int | None = None) -> str:
    shown = plan.candidates[:top] if top else plan.candidates
    rows = [
        f"| {i} | {c.label} | {c.cores} | {c.goodput:.3g} | "
        f"{c.goodput * plan.shape.output_len:.3g} | {_rate(c.p_rate)} | {_rate(c.d_rate)} | "
        f"{c.bottleneck} |"
        for i, c in enumerate(shown, 1)
    ]
    more = len(plan.candidates) - len(shown)
    s = plan.shape
    return "\n".join(
        [
            f"workload: {s.input_len} prompt tokens ({s.cached_len} cached), {s.output_len} "
            f"output tokens; SLOs: mean TTFT <= {plan.slo.ttft_s:g} s, mean TPOT <= "
            f"{plan.slo.tpot_s * 1e3:g} ms; {plan.cores} core(s)",
            "",
            "| # | candidate | cores | goodput req/s | output tok/s | P pool | D pool | "
            "bottleneck |",
            "|---:|---|---:|---:|---:|---:|---:|---|",
            *rows,
            *([f"({more} more not shown)"] if more > 0 else []),
            "",
            plan.why,
        ]
    )


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


def plan_json(plan: Plan) -> dict[str, Any]:
    def cand(c: Candidate) -> dict[str, Any]:
        return {**asdict(c), "label": c.label, "cores": c.cores}

    return {
        "shape": asdict(plan.shape),
        "slo": asdict(plan.slo),
        "cores": plan.cores,
        "feasible": plan.recommended is not None,
        "recommended": cand(plan.recommended) if plan.recommended else None,
        "why": plan.why,
        "candidates": [cand(c) for c in plan.candidates],
    }


# --------------------------------------------------------------------------- cost models


def sibling_path(path: Path, threads: int) -> Path | None:
    """The file measured with `threads` threads next to `path` (`...-t<n>.json`), if named so."""
    match = re.fullmatch(r"(.*-t)\d+\.json", path.name)
    return path.with_name(f"{match.group(1)}{threads}.json") if match else None


def load_models(
    path: Path, threads_options: Sequence[int], efficiency: float = DEFAULT_EFFICIENCY
) -> tuple[dict[int, CostModel], dict[int, str]]:
    """A model per thread count (measured where a sibling file exists, else scaled from
    `path`), and where each came from."""
    if not path.is_file():
        from pdserve.costmodel.profile import missing_profile

        raise ValueError(missing_profile(path))
    base = CostModel.load(path)
    base_threads = int(str(CostModel.load_about(path).get("threads", 1)))
    models, sources = {}, {}
    for t in threads_options:
        sib = sibling_path(path, t)
        if t == base_threads:
            models[t], sources[t] = base, f"measured ({path})"
        elif sib is not None and sib.is_file():
            models[t], sources[t] = CostModel.load(sib), f"measured ({sib})"
        else:
            models[t] = worker_model(base, t, base_threads=base_threads, efficiency=efficiency)
            factor = speedup(t, efficiency) / speedup(base_threads, efficiency)
            sources[t] = f"scaled from {base_threads} thread(s): compute / {factor:.2f}"
    return models, sources


# --------------------------------------------------------------------------- CLI


def _int_list(text: str) -> list[int]:
    """Comma-separated positive integers, sorted, repeats dropped."""
    return sorted(set(argtypes.int_list(text)))


def default_threads_options(cores: int) -> list[int]:
    """Powers of two up to `cores`, and `cores` itself."""
    return sorted({1 << i for i in range(cores.bit_length()) if 1 << i <= cores} | {cores})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--workload", choices=WORKLOADS, default="synthetic", help="sets --cached-len's default")
    a("--input-len", type=argtypes.positive_int, required=True, help="prompt tokens per request")
    a("--output-len", type=argtypes.positive_int, required=True, help="output tokens per request")
    a("--slo-ttft", type=argtypes.positive_float, required=True, help="mean time to first token, s")
    a(
        "--slo-tpot",
        type=argtypes.positive_float,
        required=True,
        help="mean time per output token, s",
    )
    a("--cores", type=argtypes.positive_int, default=os.cpu_count() or 1, help="cores to split")
    a("--cached-len", type=int, default=None, help="prompt tokens from the prefix cache")
    a("--cost-model", type=Path, default=None, help="default: the profile of this host, 1 thread")
    a("--model", default=None, help="model whose default cost model to use (SmolLM2-135M)")
    a("--threads-options", type=_int_list, default=None, help="threads per worker (1,2,4..)")
    a(
        "--parallel-efficiency",
        type=argtypes.positive_float,
        default=DEFAULT_EFFICIENCY,
        help=f"speedup(t) = 1 + e (t - 1) for thread counts not measured ({DEFAULT_EFFICIENCY})",
    )
    a("--kv-memory-gb", type=argtypes.positive_float, default=1.0, help="KV cache per worker (1.0)")
    a(
        "--kv-bytes-per-token",
        type=argtypes.positive_int,
        default=None,
        help="default: from the cost model file",
    )
    a("--top", type=argtypes.positive_int, default=None, help="show only the best N candidates")
    a("--json", action="store_true", help="print JSON instead of the table")


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit status 1 when no split meets the SLOs."""
    shape = Shape(
        args.input_len,
        args.output_len,
        args.cached_len
        if args.cached_len is not None
        else default_cached_len(args.workload, args.input_len),
    )
    slo = SLO(args.slo_ttft, args.slo_tpot)
    options = args.threads_options or default_threads_options(args.cores)
    if max(options) > args.cores:
        raise ValueError(f"--threads-options {options} has more threads than --cores {args.cores}")
    path = args.cost_model or _default_cost_model(args.model)
    models, sources = load_models(path, options, args.parallel_efficiency)
    kv_bpt = args.kv_bytes_per_token
    if kv_bpt is None:
        kv_bpt = int(str(CostModel.load_about(path).get("kv_bytes_per_token", 0)))
    max_kv = int(args.kv_memory_gb * 1024**3) // kv_bpt if kv_bpt > 0 else None
    plan = make_plan(
        models, shape, slo, args.cores, max_kv_tokens=max_kv, kv_bytes_per_token=kv_bpt
    )
    if args.json:
        body = {**plan_json(plan), "cost_models": {str(t): s for t, s in sources.items()}}
        print(json.dumps(body, indent=1))
    else:
        print(render_text(plan, args.top))
        print("\ncost models: " + "; ".join(f"{t}t {s}" for t, s in sources.items()))
        if max_kv is None:
            print("KV memory not limited: the cost model does not record KV bytes per token")
    return 0 if plan.recommended else 1


def _default_cost_model(model: str | None) -> Path:
    from pdserve.costmodel.profile import profile_path

    return profile_path(model, 1)  # the file `pdserve serve` and `bench profile` write


if __name__ == "__main__":
    from pdserve.costmodel import plan

    parser = argparse.ArgumentParser(prog="pdserve plan", description=plan.__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
