"""Stall-free batching on one colocated engine, with and without the TPOT budget.

`python -m pdserve.bench.stall_free [--slo-tpot S] [--cost-model PATH]`: an offline, engine-level
version of the colocated experiment (no HTTP, no router, so it isolates the scheduling). Per arm:
`--decodes` requests of 128 random tokens decode `--decode-tokens` tokens each; long prompts of
`--prompt-len` tokens arrive at fixed steps (every `--every` steps, `--arrivals` of them). The
time between consecutive tokens of every decode stream is a TPOT sample (p50/p90/max); TTFT of
each long prompt counts from the step it arrived. Arm "whole": today's scheduling (decode-first,
a prompt takes whatever of the 2048-token budget the decodes leave). Arm "stall-free": the same
plus `SchedulerPolicy.prefill_budget` from the TPOT SLO and this host's cost model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.bench.harness import report
from pdserve.percentiles import percentile


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slo-tpot", type=float, default=0.5)
    p.add_argument("--cost-model", type=Path, default=None, help="default: this host's saved one")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=60)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--arrivals", type=int, default=3)
    p.add_argument("--every", type=int, default=15)
    p.add_argument("--output", type=Path, default=Path("docs/benchmarks/stall-free.md"))
    return p.parse_args(argv)


def run_arm(args: argparse.Namespace, budget: Any) -> dict[str, Any]:
    import torch

    from pdserve.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.request import SamplingParams

    eng = LLMEngine(EngineConfig.from_kwargs(threads=args.threads), budget)
    gen = torch.Generator().manual_seed(0)
    ids = [
        eng.add_request(
            torch.randint(3, 49152, (128,), generator=gen).tolist(),
            SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True),
        )
        for _ in range(args.decodes)
    ]
    last: dict[str, float] = {}
    tpot: list[float] = []
    arrived: dict[str, float] = {}
    ttft: list[float] = []
    step = 0
    while eng.has_unfinished_requests():
        if step % args.every == args.every - 1 and len(arrived) < args.arrivals:
            prompt = torch.randint(3, 49152, (args.prompt_len,), generator=gen).tolist()
            rid = eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
            arrived[rid] = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        step += 1
        for o in outs:
            if not o.new_token_ids:
                continue
            if o.request_id in ids:
                if o.request_id in last:
                    tpot.append(now - last[o.request_id])
                last[o.request_id] = now
            elif o.request_id in arrived and len(o.outputs[0].token_ids) == len(o.new_token_ids):
                ttft.append(now - arrived[o.request_id])
    return {
        "steps": step,
        "tpot_p50": percentile(tpot, 50),
        "tpot_p90": percentile(tpot, 90),
        "tpot_max": max(tpot),
        "ttft": ttft,
    }


def main(argv: list[str] | None = None) -> int:
    from pdserve.costmodel.model import CostModel, default_path
    from pdserve.engine.step_budget import tpot_prefill_budget

    args = _args(argv)
    from pdserve.costmodel import profile

    path = args.cost_model or default_path(profile.model_path(None), args.threads)
    cost = CostModel.load(path)
    budget = tpot_prefill_budget(cost, args.slo_tpot, 2048)
    rows = {}
    for name, b in (("whole", None), ("stall-free", budget)):
        print(f"stall-free bench: arm {name}", file=sys.stderr, flush=True)
        rows[name] = run_arm(args, b)
    info = report.machine_info(args.threads)
    cmd = report.command_line(argv, "python -m pdserve.bench.stall_free")
    lines = [
        "# Stall-free batching on a colocated engine",
        "",
        f"`{cmd}` — {info['cpu']}, {info['cores']} cores, {args.threads} thread(s), "
        f"load average {report.load_text(info['load_average'])}; cost model "
        f"`{path.name}`; TPOT SLO {args.slo_tpot} s; {args.decodes} decode streams x "
        f"{args.decode_tokens} tokens, {args.arrivals} prompts of {args.prompt_len} tokens "
        f"arriving every {args.every} steps.",
        "",
        *report.markdown_table(
            (
                "arm",
                "steps",
                "TPOT p50 s",
                "TPOT p90 s",
                "TPOT max s",
                "TTFT of the long prompts, s",
            ),
            [
                (
                    name,
                    r["steps"],
                    f"{r['tpot_p50']:.3f}",
                    f"{r['tpot_p90']:.3f}",
                    f"{r['tpot_max']:.3f}",
                    ", ".join(f"{t:.1f}" for t in r["ttft"]),
                )
                for name, r in rows.items()
            ],
            "lrrrrl",
        ),
    ]
    md = "\n".join(lines) + "\n"
    report.write_report(md, {"machine": info, "rows": rows}, args.output, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
