"""`pdserve` command line: serve | router | worker | generate | demo | chaos | bench | plan | top.

Engine flags are generated from the config dataclasses (`pdserve.config`), so every engine
argument of `LLM(**engine_args)` is also a flag with the same name and help.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from pdserve.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    add_config_args,
    engine_kwargs_from_args,
)

DEMO_QUESTION = "What is the capital of France?"


def _engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig):
        add_config_args(group, cls)  # type: ignore[arg-type]


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt offline and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _sampling_args(gen)
    _engine_args(gen)

    demo = sub.add_parser("demo", help="offline demo: ask the default model a question")
    demo.add_argument("--question", default=DEMO_QUESTION)
    _sampling_args(demo)
    _engine_args(demo)

    from pdserve.serve import flags as serve_flags

    serve = sub.add_parser("serve", help="workers + OpenAI-compatible router on this machine")
    serve_flags.add_serve_arguments(serve)
    router = sub.add_parser("router", help="the router alone, for workers started elsewhere")
    serve_flags.add_router_arguments(router)

    worker = sub.add_parser("worker", help="run one prefill/decode/colocated worker")
    from pdserve.workers.worker import add_arguments as worker_arguments

    worker_arguments(worker)
    _engine_args(worker)

    from pdserve import chaos

    chaos_p = sub.add_parser(
        "chaos",
        help="load a local cluster while killing/stalling/restarting workers; count losses",
        description=chaos.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chaos.add_arguments(chaos_p)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    eng = bench_sub.add_parser("engine", help="prefill/decode throughput, MFU and MBU")
    from pdserve.bench.load import serve_bench
    from pdserve.bench.micro import codec_bench, engine_bench
    from pdserve.bench.transfer import transfer_bench

    engine_bench.add_arguments(eng)
    codec = bench_sub.add_parser("codec", help="KV codec quality (token match, KL) and speed")
    codec_bench.add_arguments(codec)
    from pdserve.bench import quant_bench

    qb = bench_sub.add_parser(
        "quant",
        help="quantized weights vs float32 (agreement, KL), with llama.cpp side by side",
        description=quant_bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    quant_bench.add_arguments(qb)
    from pdserve.bench import gguf_files

    gq = bench_sub.add_parser(
        "gguf-requant",
        help="write the model in another GGUF block format (Q4_K_M ...) with llama.cpp's quantizer",
        description=gguf_files.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gguf_files.add_arguments(gq)
    transfer = bench_sub.add_parser("transfer", help="KV transfer throughput, TTFT breakdown")
    transfer_bench.add_arguments(transfer)
    load = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server: goodput")
    serve_bench.add_arguments(load)
    from pdserve.bench.load import replay

    rep = bench_sub.add_parser(
        "replay",
        help="replay a production trace's window (Mooncake, Azure), prefix reuse kept",
        description=replay.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_arguments(rep)
    from pdserve.bench import mlperf

    mlp = bench_sub.add_parser(
        "mlperf",
        help="MLPerf LoadGen's Server scenario (TTFT/TPOT limits) on the knowledge-base QA",
        description=mlperf.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mlperf.add_arguments(mlp)
    from pdserve.bench import attention_bench

    attn = bench_sub.add_parser("attention", help="paged attention kernel vs gather: step times")
    attention_bench.add_arguments(attn)
    from pdserve.bench import compare

    cmp = bench_sub.add_parser(
        "compare",
        help="one workload against pdserve colocated, 1P1D and peer servers: goodput, plots",
        description=compare.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_arguments(cmp)
    from pdserve.bench import sweep

    swp = bench_sub.add_parser(
        "sweep",
        help="goodput and SLO attainment against request rate per system, each curve's knee",
        description=sweep.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep.add_arguments(swp)
    from pdserve.bench import sweep_resim

    resim = bench_sub.add_parser(
        "sweep-sim",
        help="predict a finished sweep again with this simulator (measured points kept)",
        description=sweep_resim.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep_resim.add_arguments(resim)
    from pdserve.bench import profile

    prof = bench_sub.add_parser(
        "profile",
        help="measure this machine's engine and fit its cost model (router, plan)",
        description=profile.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    profile.add_arguments(prof)
    from pdserve.bench import kvpool_bench

    kvp = bench_sub.add_parser(
        "kvpool",
        help="KV pool tiers (memory, disk, Redis): bandwidth vs recomputing the tokens",
        description=kvpool_bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kvpool_bench.add_arguments(kvp)
    from pdserve.bench import sched

    sch = bench_sub.add_parser(
        "sched",
        help="scheduling features (admission, conditional, prefix, autobalance): A vs B",
        description=sched.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sched.add_arguments(sch)
    from pdserve.bench import kvpool_serve

    kvs = bench_sub.add_parser(
        "kvpool-serve",
        help="KV pool end to end: two serve instances sharing a pool (TTFT, prefill tokens), "
        "recovery of a killed D; pool on vs off",
        description=kvpool_serve.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kvpool_serve.add_arguments(kvs)
    from pdserve.bench import spec_crossover

    spc = bench_sub.add_parser(
        "spec-crossover",
        help="decode step with and without k draft rows per request: the batch from which "
        "speculation stops paying (disable_by_batch_size)",
        description=spec_crossover.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    spec_crossover.add_arguments(spc)
    from pdserve.bench import spec_drafts

    sdr = bench_sub.add_parser(
        "spec-drafts",
        help="prompt-lookup drafts on this model's greedy answers: acceptance by match "
        "length, and the tokens per step's time pacing could reach at a verify row's cost",
        description=spec_drafts.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    spec_drafts.add_arguments(sdr)
    from pdserve.costmodel import plan, plan_cli

    plan_p = sub.add_parser(
        "plan",
        help="recommend a P:D split and threads per worker from the cost model",
        description=plan.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan_cli.add_arguments(plan_p)
    from pdserve.sim import search as sim_search

    sim_search.add_arguments(plan_p)  # --simulate and its flags
    from pdserve.sim import cli as sim_cli

    sim_p = sub.add_parser(
        "sim",
        help="simulate a deployment (router, P/D or colocated pools, links) on a workload",
        description=sim_cli.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim_cli.add_arguments(sim_p)

    from pdserve import top

    top_p = sub.add_parser(
        "top",
        help="the router's live dashboard in the terminal",
        description=top.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_arguments(top_p)
    return parser


def _params(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pdserve import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM

    llm = LLM(**engine_kwargs_from_args(args))
    params = _params(args)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = llm.generate([args.prompt], params)
    print(out[0].outputs[0].text)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pdserve import LLM

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs_from_args(args))
    loaded = time.perf_counter()
    out = llm.chat([{"role": "user", "content": args.question}], _params(args))[0]
    done = time.perf_counter()
    name = llm.engine.arch.name or llm.engine.source.path.name
    print(f"model: {name} ({llm.engine.source.kind}, loaded in {loaded - t0:.1f}s)")
    print(f"Q: {args.question}")
    print(f"A: {out.outputs[0].text.strip()}")
    n = len(out.outputs[0].token_ids)
    print(f"({n} tokens in {done - loaded:.2f}s, finish: {out.outputs[0].finish_reason})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "serve":
            from pdserve.serve import flags as serve_flags
            from pdserve.serve import local

            return local.run(serve_flags.deployment(args))
        if args.command == "router":
            from pdserve.serve import flags as serve_flags
            from pdserve.serve import local

            return local.run_router(*serve_flags.router_deployment(args))
        if args.command == "chaos":
            from pdserve import chaos

            return chaos.run(args)
        if args.command == "plan" and args.simulate:
            from pdserve.sim import search as sim_search

            return sim_search.run(args)
        if args.command == "plan":
            from pdserve.costmodel import plan_cli

            return plan_cli.run(args)
        if args.command == "sim":
            from pdserve.sim import cli as sim_cli

            return sim_cli.run(args)
        if args.command == "top":
            from pdserve import top

            return top.run(args)
        if args.command == "worker":
            from pdserve.workers.worker import run as run_worker

            return run_worker(args, engine_kwargs_from_args(args))
        if args.command == "bench":
            from pdserve.bench import (
                attention_bench,
                compare,
                gguf_files,
                kvpool_bench,
                profile,
                quant_bench,
                sched,
                spec_crossover,
                spec_drafts,
            )
            from pdserve.bench.load import serve_bench
            from pdserve.bench.micro import codec_bench, engine_bench
            from pdserve.bench.transfer import transfer_bench

            if args.bench_command == "compare":
                return compare.run(args, argv if argv is not None else sys.argv[1:])
            if args.bench_command == "sweep":
                from pdserve.bench import sweep

                return sweep.run(args, argv if argv is not None else sys.argv[1:])
            if args.bench_command == "sweep-sim":
                from pdserve.bench import sweep_resim

                return sweep_resim.run(args)
            if args.bench_command == "sched":
                return sched.run(args, argv if argv is not None else sys.argv[1:])
            if args.bench_command == "mlperf":
                from pdserve.bench import mlperf

                return mlperf.run(args)
            if args.bench_command == "replay":
                from pdserve.bench.load import replay

                return replay.run(args)
            if args.bench_command == "kvpool-serve":
                from pdserve.bench import kvpool_serve

                return kvpool_serve.run(args)
            runners = {
                "engine": engine_bench.run,
                "codec": codec_bench.run,
                "transfer": transfer_bench.run,
                "serve": serve_bench.run,
                "profile": profile.run,
                "quant": quant_bench.run,
                "gguf-requant": gguf_files.run,
                "attention": attention_bench.run,
                "kvpool": kvpool_bench.run,
                "spec-crossover": spec_crossover.run,
                "spec-drafts": spec_drafts.run,
            }
            return runners[args.bench_command](args)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
