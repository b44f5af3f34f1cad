"""`pdserve sim`: simulate a deployment on a workload and print TTFT / TPOT, attainment, goodput.

    pdserve sim --hardware h100 --model llama-3.1-8b --prefill 2 --decode 1 --workload rag \\
        --input-len 2000 --output-len 300 --rate 8 --num-requests 500 --slo-ttft 1 --slo-tpot 0.05

Hardware `cpu` uses this host's profiled cost model (`pdserve bench profile`) and the default
model; GPUs (a100, h100, h200) use the roofline step model with a shipped model shape
(`--model llama-3.1-8b|llama-3.1-70b|qwen2.5-7b|qwen2.5-32b` or a config.json path).

`--concurrency N [--think-time S --think-dist exponential|fixed]` sends the requests as
`bench serve --concurrency` does (a closed loop; sim/closedloop.py) instead of at `--rate`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pdserve import argtypes
from pdserve.config import CacheConfig, RouterConfig
from pdserve.deployment import ADAPTIVE_SLO_TPOT_S, ADAPTIVE_SLO_TTFT_S
from pdserve.deployment import Deployment as ServedDeployment
from pdserve.sim import hardware, spec
from pdserve.sim.closedloop import ClosedLoop
from pdserve.sim.deploy import Deployment, render, simulate
from pdserve.sim.workload import SIM_WORKLOADS, make_requests, scaling_from_args, trace_requests
from pdserve.workloads import streams as bw
from pdserve.workloads.spec import THINK_DISTS
from pdserve.workloads.spec import default as load_default
from pdserve.workloads.traces import expected_prefix_hits, read_trace


def _pos_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _nonneg_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def _pos_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--workload", choices=SIM_WORKLOADS, default="synthetic", help="request shapes")
    a("--input-len", type=_pos_int, default=512, help="mean prompt tokens")
    a("--output-len", type=_pos_int, default=128, help="mean output tokens")
    a("--len-spread", type=float, default=0.0, help="lengths uniform in mean x (1 +- spread)")
    a("--turns", type=_pos_int, default=3, help="multiturn: turns per conversation")
    a("--seed", type=int, default=0)
    a("--arrival-cv", type=_pos_float, default=1.0, help="gamma arrivals' cv (1: Poisson)")
    a("--bench-arrivals", action="store_true",
      help="the arrival times `pdserve bench serve` sends at for the same --rate and --seed "
      "(burstiness 1 / cv^2), to predict a measured run")  # fmt: skip
    a("--trace", type=Path, default=None,
      help="replay a trace (Mooncake .jsonl, Azure .csv, or CSV arrival_s,input_tokens,"
      "output_tokens) instead of --workload/--rate/--num-requests")  # fmt: skip
    a("--limit", type=_pos_int, default=None, help="--trace: requests in the window (all)")
    a("--start-ms", type=argtypes.non_negative_float, default=0.0,
      help="--trace: the window's start, ms")  # fmt: skip
    a("--length-scale", type=_pos_float, default=1.0,
      help="--trace: prompt, 512-token block and output lengths x this (1)")  # fmt: skip
    a("--time-scale", type=_pos_float, default=1.0,
      help="--trace: arrival times x this (2: half the rate)")  # fmt: skip
    bw.add_arguments(parser)


def add_deployment_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--hardware", default="h100", help=f"one of {', '.join(hardware.HARDWARE)}")
    a("--tp-prefill", type=_pos_int, default=1, help="tensor parallelism of a prefill worker")
    a("--tp-decode", type=_pos_int, default=1, help="... of a decode (or colocated) worker")
    a("--link-gbps", type=_pos_float, default=None, help="P->D link per GPU, Gbit/s (400)")
    a("--per-message-ms", type=float, default=0.5, help="fixed cost of one KV transfer, ms")
    a("--max-batched-tokens", type=_pos_int, default=2048, help="token budget (chunk size)")
    a("--max-num-seqs", type=_pos_int, default=256, help="running requests cap per worker")
    a("--cost-model", type=Path, default=None, help="cpu: the profiled cost model JSON")
    a("--kv-cache-gb", type=_pos_float, default=1.0, help="cpu: KV memory per worker")
    a("--no-contention", action="store_true",
      help="cpu: workers as independent machines (ignore the profiled contention)")  # fmt: skip
    a("--slo-ttft", type=_pos_float, default=None, help="TTFT SLO, s")
    a("--slo-tpot", type=_pos_float, default=None, help="TPOT SLO, s")
    a("--spec-tokens", type=_nonneg_int, default=0,
      help="speculative decoding: draft tokens per decode step (0: off)")  # fmt: skip
    a("--spec-acceptance", type=argtypes.fraction, default=None,
      help="--spec-tokens: the probability that a draft token is accepted")  # fmt: skip
    a("--spec-draw", choices=spec.DRAWS, default="sampled",
      help="accepted drafts per step: sampled (seeded) or the expectation")  # fmt: skip
    a("--spec-pacing", action="store_true",
      help="the engine's draft pacer: drafts a step capped by the step model's price of verify "
      "rows and the acceptance so far, as pdserve serve paces them (default: always "
      "--spec-tokens)")  # fmt: skip
    a("--multiturn-reuse", action=argparse.BooleanOptionalAction, default=True,
      help="a later turn goes to the D that decoded the previous one, as the router sends it: "
      "prefilled there when at most --conversation-local-tokens of it are not cached there, "
      "else on P (--no-multiturn-reuse: routed like any request, no turn kept)")  # fmt: skip
    a("--conversation-ttl", type=argtypes.non_negative_float,
      default=CacheConfig.conversation_ttl,
      help="seconds D keeps a finished turn's KV for the next turn, as the server's flag "
      "(released earlier under memory pressure; 0: not kept)")  # fmt: skip
    a("--conversation-local-tokens", type=_nonneg_int,
      default=RouterConfig.conversation_local_tokens,
      help="a follow-up with at most this many tokens not cached on its D is prefilled "
      "there, as the server's flag (0: always on P)")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--config", type=Path, default=None, metavar="YAML",
      help="the deployment file `pdserve serve --config` reads: its pools, SLOs, planner and "
      "engine budgets (the flags here add hardware, TP, link)")  # fmt: skip
    a("--model", default=None, help="model name or config.json (default: llama-3.1-8b; cpu: "
      "the default GGUF)")  # fmt: skip
    a("--sliding-window", type=_pos_int, default=None,
      help="the model's sliding window in tokens, over its config's (on every layer unless "
      "--sliding-layers or the config says which)")  # fmt: skip
    a("--sliding-layers", default=None, metavar="all|PATTERN",
      help="which layers slide: all, or s (sliding) and f (full) repeated over the layers "
      "from the first (sf: Gemma 2; sssssf: Gemma 3)")  # fmt: skip
    pools = parser.add_mutually_exclusive_group()
    pools.add_argument("--colocated", type=_pos_int, default=None, help="colocated workers")
    pools.add_argument("--prefill", type=_pos_int, default=None, help="prefill workers")
    a("--decode", type=_pos_int, default=None, help="decode workers (with --prefill)")
    add_deployment_arguments(parser)
    add_workload_arguments(parser)
    a("--rate", type=_pos_float, default=1.0, help="requests/s")
    a("--num-requests", type=_pos_int, default=200)
    add_closed_loop_arguments(parser)
    a("--router", choices=("round_robin", "planner"), default=None,
      help="round_robin, or the SLO planner (default: planner when an SLO is given)")  # fmt: skip
    a("--admission", action=argparse.BooleanOptionalAction, default=None,
      help="reject predicted SLO misses (needs SLOs); on by default with --adaptive, as "
      "`pdserve serve --adaptive` has it")  # fmt: skip
    a("--disaggregation", choices=("always", "conditional", "overflow"), default="always")
    a("--adaptive", action="store_true",
      help="cpu: `pdserve serve --adaptive`: the planner with overflow, P's and D's threads "
      "moved within --cores by the router's policy (router/threads.py)")  # fmt: skip
    a("--cores", type=_pos_int, default=2, help="--adaptive: the cores P and D share")
    a("--threads", type=_pos_int, default=None,
      help="cpu: torch threads each worker runs, as pdserve serve --threads (the cost model "
      "profiled at that many: bench profile --threads N); default one, or cores / 2 with "
      "--adaptive")  # fmt: skip
    a("--prefix-routing", action="store_true")
    a("--kv-pool", action="store_true",
      help="a KV pool shared by every worker: blocks put as computed, prefixes loaded")  # fmt: skip
    a("--kv-pool-gb", type=_pos_float, default=None, help="--kv-pool: capacity (unbounded)")
    a("--kv-pool-gbps", type=_pos_float, default=None,
      help="--kv-pool: its link per worker, Gbit/s (the P->D link's)")  # fmt: skip
    a("--autobalance", action="store_true")
    a("--message-ms", type=float, default=0.0, help="router <-> worker message latency, ms")
    a("--json", action="store_true", help="print JSON")


def add_closed_loop_arguments(parser: argparse.ArgumentParser) -> None:
    """`bench serve`'s closed-loop flags, with their names and meaning."""
    a = parser.add_argument
    a("--concurrency", type=_pos_int, default=None,
      help="a closed loop, as `bench serve --concurrency`: at most N requests in flight, "
      "instead of arrivals at --rate (default: off)")  # fmt: skip
    a("--think-time", type=argtypes.non_negative_float, default=load_default("think_time"),
      help="--concurrency: seconds a conversation waits between an answer and its next turn "
      "(the mean; multiturn)")  # fmt: skip
    a("--think-dist", choices=THINK_DISTS, default=load_default("think_dist"),
      help="think times: exponential (seeded by --seed, mean --think-time) or fixed")  # fmt: skip


def load_from_args(args: argparse.Namespace) -> ClosedLoop | None:
    """The closed loop the flags ask for; None: the open loop (arrivals at --rate)."""
    concurrency = getattr(args, "concurrency", None)
    replayed = concurrency is not None or getattr(args, "trace", None)
    if getattr(args, "bench_arrivals", False) and replayed:
        raise ValueError("--bench-arrivals is for arrivals at --rate (no --trace, --concurrency)")
    if concurrency is None:
        if getattr(args, "think_time", 0.0):
            # the open loop sends a later turn when the previous one ends, at its own arrival
            raise ValueError("--think-time needs --concurrency N (a closed loop)")
        return None
    if getattr(args, "trace", None):
        raise ValueError("--concurrency replaces arrival times; --trace replays its own")
    return ClosedLoop(concurrency, args.think_time, args.think_dist, args.seed)


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    hw = args.hardware.lower()
    if hw not in hardware.HARDWARE:
        raise ValueError(f"unknown hardware {args.hardware!r}; choose one of "
                         f"{', '.join(hardware.HARDWARE)}")  # fmt: skip
    if getattr(args, "config", None) is not None:
        return _from_config(args, hw)
    if args.colocated is None and (args.prefill is None) != (args.decode is None):
        raise ValueError("give --prefill N with --decode M, or --colocated N")
    if args.per_message_ms < 0 or args.message_ms < 0:
        raise ValueError("--per-message-ms and --message-ms must be >= 0")
    colocated = args.colocated or 0
    prefill = args.prefill or (0 if colocated else 1)
    decode = args.decode or (0 if colocated else 1)
    model = args.model or ("default" if hw == "cpu" else "llama-3.1-8b")
    adaptive = getattr(args, "adaptive", False)
    if adaptive and (args.colocated or (args.prefill or 1) != 1 or (args.decode or 1) != 1):
        raise ValueError("--adaptive simulates one prefill and one decode worker")
    if adaptive:  # as the served deployment adapts its planner (deployment.adapted)
        args.router, args.disaggregation = "planner", "overflow"
        args.slo_ttft = args.slo_ttft or ADAPTIVE_SLO_TTFT_S
        args.slo_tpot = args.slo_tpot or ADAPTIVE_SLO_TPOT_S
        args.admission = True if args.admission is None else args.admission
    args.admission = bool(args.admission)
    planner = args.router or ("planner" if args.slo_ttft or args.slo_tpot else "round_robin")
    want_planner = planner == "planner"
    if (args.admission or args.prefix_routing or args.autobalance) and not want_planner:
        raise ValueError("--admission, --prefix-routing and --autobalance need --router planner")
    if (args.kv_pool_gb or args.kv_pool_gbps) and not args.kv_pool:
        raise ValueError("--kv-pool-gb and --kv-pool-gbps need --kv-pool")
    if args.admission and not (args.slo_ttft or args.slo_tpot):
        raise ValueError("--admission needs --slo-ttft and/or --slo-tpot")
    return Deployment(
        spec=spec_from_args(args),
        multiturn_reuse=args.multiturn_reuse,
        conversation_ttl_s=getattr(args, "conversation_ttl", CacheConfig.conversation_ttl),
        conversation_local_tokens=getattr(
            args, "conversation_local_tokens", RouterConfig.conversation_local_tokens
        ),
        hardware=hw,
        model=model,
        prefill=prefill,
        decode=decode,
        colocated=colocated,
        tp_prefill=args.tp_prefill,
        tp_decode=args.tp_decode,
        link_gbps=args.link_gbps,
        per_message_s=args.per_message_ms / 1e3,
        max_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
        planner=want_planner,
        admission=args.admission,
        disaggregation=args.disaggregation,
        prefix_routing=args.prefix_routing,
        autobalance=args.autobalance,
        expected_output=args.output_len,
        cost_model=args.cost_model,
        kv_cache_gb=args.kv_cache_gb,
        shared_host=not args.no_contention,
        message_s=args.message_ms / 1e3,
        kv_pool=args.kv_pool,
        kv_pool_gb=args.kv_pool_gb,
        kv_pool_gbps=args.kv_pool_gbps,
        cores=args.cores if adaptive else 0,
        threads=args.threads or 0,
        **_window_flags(args),
    )


def _window_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "sliding_window": getattr(args, "sliding_window", None),
        "sliding_layers": getattr(args, "sliding_layers", None),
    }


def spec_from_args(args: argparse.Namespace) -> spec.SpecModel | None:
    """The speculation flags as a model (None: --spec-tokens 0); both or neither."""
    tokens, acceptance = getattr(args, "spec_tokens", 0), getattr(args, "spec_acceptance", None)
    if not tokens:
        if acceptance is not None:
            raise ValueError("--spec-acceptance needs --spec-tokens K (K >= 1)")
        return None
    if acceptance is None:
        raise ValueError("--spec-tokens needs --spec-acceptance A (per draft token, 0..1)")
    draw, paced = getattr(args, "spec_draw", "sampled"), getattr(args, "spec_pacing", False)
    return spec.SpecModel(tokens, acceptance, draw, args.seed, paced)


# The flags a deployment file sets instead, with their defaults.
FILE_OWNS = {
    "prefill": None, "decode": None, "colocated": None, "slo_ttft": None, "slo_tpot": None,
    "router": None, "admission": None, "disaggregation": "always", "prefix_routing": False,
    "autobalance": False, "max_batched_tokens": 2048, "max_num_seqs": 256, "kv_cache_gb": 1.0,
    "adaptive": False, "cores": 2, "conversation_ttl": CacheConfig.conversation_ttl,
    "conversation_local_tokens": RouterConfig.conversation_local_tokens, "threads": None,
}  # fmt: skip


def _from_config(args: argparse.Namespace, hw: str) -> Deployment:
    """The served deployment of --config, on the hardware and links the flags describe."""
    clash = sorted(k for k, default in FILE_OWNS.items() if getattr(args, k) != default)
    if clash:
        flags = ", ".join("--" + k.replace("_", "-") for k in clash)
        raise ValueError(f"with --config, set {flags} in the deployment file")
    served = ServedDeployment.from_yaml(args.config)
    model = args.model or ((served.model or "default") if hw == "cpu" else "llama-3.1-8b")
    sim: dict[str, Any] = {"hardware": hw, "model": model, "tp_prefill": args.tp_prefill,
                           "tp_decode": args.tp_decode, "link_gbps": args.link_gbps,
                           "per_message_s": args.per_message_ms / 1e3,
                           "shared_host": not args.no_contention,
                           "message_s": args.message_ms / 1e3, "kv_pool": args.kv_pool,
                           "kv_pool_gb": args.kv_pool_gb,
                           "kv_pool_gbps": args.kv_pool_gbps, "spec": spec_from_args(args),
                           "multiturn_reuse": args.multiturn_reuse,
                           **_window_flags(args)}  # fmt: skip
    if args.cost_model is not None:
        sim["cost_model"] = args.cost_model
    return Deployment.of(served, **sim)


def run(args: argparse.Namespace) -> int:
    d = deployment_from_args(args)
    load = load_from_args(args)
    trace = None
    if args.trace:
        trace = read_trace(args.trace, scaling_from_args(args))
        requests = trace_requests(trace, args.seed)
    else:
        requests = make_requests(args)
    t0 = time.perf_counter()
    result: dict[str, Any] = simulate(d, requests, load=load)
    result["wall_s"] = time.perf_counter() - t0
    if trace is not None:
        # the reuse the trace promises (an unbounded cache) beside what the workers' caches got
        result["trace"] = {**trace.config(), **expected_prefix_hits(trace.requests)}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    if trace is not None:
        t = result["trace"]
        print(f"trace: {t['trace']} ({t['format']}); {t['scaling']}; the trace's own prefix "
              f"reuse {t['prefix_hit_ratio']:.1%} of prompt tokens (unbounded cache)")  # fmt: skip
    print(render(result, d.slo_ttft_s, d.slo_tpot_s))
    print(f"(simulated in {result['wall_s']:.2f} s of wall time)")
    return 0
