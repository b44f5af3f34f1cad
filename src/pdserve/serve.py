"""`pdserve serve` (workers + router on this machine) and `pdserve router` (router alone).

serve: start the workers as child processes, wait until each has loaded the model, start the
router (FastAPI on uvicorn), print the URL. On Ctrl-C / SIGTERM uvicorn stops accepting, lets
in-flight requests finish for up to `--drain` seconds, then the workers are shut down; exit 0.
Internal sockets bind to 127.0.0.1; a router bound beyond loopback without --api-key warns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq

from pdserve.config import (
    KV_POOL_FIELDS,
    EngineConfig,
    RouterConfig,
    WorkerConfig,
    add_config_args,
    add_engine_overrides,
    config_from_args,
    engine_overrides,
)
from pdserve.costmodel.model import CostModel
from pdserve.engine import loader
from pdserve.launcher import Launched, WorkerSpec, await_ready, launch, relaunch, stop
from pdserve.router.slo import SloPlanner
from pdserve.workers import auth
from pdserve.workers import messages as m

log = logging.getLogger("pdserve.serve")
STARTUP_TIMEOUT_S = 300.0
# Engine settings `pdserve serve` passes to every worker it starts: a new one is its name here.
SERVE_ENGINE_ARGS = (
    "block_size",
    "decode_matmul",
    "kv_cache_memory_gb",
    "kv_cache_dtype",
    "max_num_batched_tokens",
    "prefill_format",
    "quantization",
)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, RouterConfig)
    parser.add_argument(
        "--secret-file",
        default=None,
        help="shared secret authenticating control messages (else $PDSERVE_SECRET); required "
        "when workers are not on loopback",
    )
    parser.add_argument("--host", default="127.0.0.1", help="router address (loopback)")
    parser.add_argument("--port", type=int, default=8000, help="router port")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (or set PDSERVE_API_KEY)",
    )
    parser.add_argument("--served-model-name", default=None, help="model id in the API")
    parser.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO, seconds")
    parser.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO, seconds")
    parser.add_argument(
        "--admission",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with an SLO set, reject (429 + Retry-After) requests predicted to miss it",
    )
    parser.add_argument(
        "--cost-model",
        default="auto",
        help="cost model JSON (pdserve bench profile); 'auto': this host's saved one, profiled "
        "at start-up when SLOs, --autobalance or --disaggregation conditional need it; 'none'",
    )
    parser.add_argument(
        "--disaggregation",
        choices=("auto", "conditional", "always"),
        default="auto",
        help="conditional: per request, prefill on P or locally on D, whichever the cost model "
        "predicts better; always: every request through P; auto: conditional with a cost model",
    )
    parser.add_argument(
        "--autobalance",
        action="store_true",
        help="move workers between the prefill and decode pools when one stays saturated "
        "while the other idles",
    )
    parser.add_argument(
        "--expected-output",
        type=int,
        default=256,
        help="tokens the planner assumes a request generates when max_tokens is larger",
    )
    parser.add_argument(
        "--kv-pool-gbps",
        type=float,
        default=1.0,
        help="the planner's first guess of how fast a worker loads KV from its pool, GB/s "
        "(`pdserve bench kvpool`'s get GB/s for the tier); each worker's loads then replace it",
    )
    parser.add_argument(
        "--drain",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish at shutdown",
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF folder or .gguf file; default: SmolLM2-135M-Instruct",
    )
    parser.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    parser.add_argument("--decode", type=int, default=None, help="decode workers (default 1)")
    parser.add_argument(
        "--colocated", type=int, default=0, help="colocated workers instead of P/D pools"
    )
    parser.add_argument("--transport", default="tcp", help="KV transport: tcp | ipc | shm")
    parser.add_argument("--kv-codec", default="none", help="KV wire codec: none | int8 | int4")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker; default: cores / workers",
    )
    add_engine_overrides(parser, SERVE_ENGINE_ARGS)
    # --kv-pool-*: WorkerConfig's pool fields, handed to every worker
    others = tuple(f.name for f in dataclasses.fields(WorkerConfig) if f.name not in KV_POOL_FIELDS)
    add_config_args(parser, WorkerConfig, skip=others)
    parser.add_argument(
        "--stall-free",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --slo-tpot and a cost model: colocated and decode workers size each step's "
        "prompt tokens so running decodes stay within the TPOT SLO (stall-free batching)",
    )
    parser.add_argument(
        "--restart-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="restart a worker process that exits, on the same addresses",
    )
    add_ray_arguments(parser)
    add_common_arguments(parser)


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ray (pdserve/ray/)")
    group.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=None,
        metavar="auto|ADDRESS",
        help="run each worker as a Ray actor: 'auto' starts Ray on this machine, an address "
        "(ray://host:10001, host:6379) joins a cluster; Ray places (custom resources "
        "pdserve_prefill / pdserve_decode, else CPUs), restarts and resizes (POST "
        "/admin/pools) the workers; the router stays here",
    )
    group.add_argument(
        "--ray-cpus-per-worker",
        type=float,
        default=None,
        help="Ray CPUs each worker actor reserves, also its torch threads (default: with "
        "--ray auto, cores / workers; else 1)",
    )
    group.add_argument(
        "--ray-max-restarts",
        type=int,
        default=-1,
        help="times Ray restarts a dead worker actor (-1: always)",
    )
    group.add_argument(
        "--ray-dashboard",
        action="store_true",
        help="start Ray's dashboard with --ray auto (off by default)",
    )


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="*", default=[], help="prefill worker control URLs")
    parser.add_argument("--decode", nargs="*", default=[], help="decode worker control URLs")
    parser.add_argument("--colocated", nargs="*", default=[], help="colocated worker URLs")
    parser.add_argument("--model", default=None, help="for the tokenizer; default: the workers'")
    add_common_arguments(parser)


def _worker_specs(args: argparse.Namespace) -> list[WorkerSpec]:
    if args.colocated and (args.prefill or args.decode):
        raise ValueError("give either --colocated N or --prefill N --decode M, not both")
    counts = (
        {"colocated": args.colocated}
        if args.colocated
        else {"prefill": args.prefill or 1, "decode": args.decode or 1}
    )
    total = sum(counts.values())
    overrides = engine_overrides(args, SERVE_ENGINE_ARGS)
    EngineConfig.from_kwargs(**overrides)  # a bad value: one ValueError here, before any start
    engine: dict[str, Any] = {
        "threads": args.threads or max(1, (os.cpu_count() or 1) // total),
        **({"model": args.model} if args.model is not None else {}),
        **overrides,
    }
    return [
        WorkerSpec(
            role,
            f"{role[0].upper()}{i}",
            engine,
            WorkerConfig(
                transport=args.transport,
                kv_codec=args.kv_codec,
                deadline_s=args.deadline_s,
                **{f: getattr(args, f) for f in KV_POOL_FIELDS},
            ),
        )
        for role, n in counts.items()
        for i in range(n)
    ]


def _with_stall_free(
    args: argparse.Namespace, specs: list[WorkerSpec], cost: CostModel | None, threads: int
) -> list[WorkerSpec]:
    """Hand the TPOT SLO and the cost model file to the workers that run decodes."""
    if not args.stall_free or args.slo_tpot is None or cost is None:
        return specs
    if args.cost_model not in ("auto", "none"):
        path = Path(args.cost_model)
    else:
        path = _default_cost_path(args, args.model, threads)
    return [
        dataclasses.replace(
            s, config=dataclasses.replace(s.config, slo_tpot_s=args.slo_tpot, cost_model=str(path))
        )
        if s.role in ("colocated", "decode")
        else s
        for s in specs
    ]


def _needs_cost_model(args: argparse.Namespace) -> bool:
    slo = args.slo_ttft is not None or args.slo_tpot is not None
    return (slo and args.admission) or args.autobalance or args.disaggregation == "conditional"


def _cost_model(
    args: argparse.Namespace, model: str | None, threads: int, may_profile: bool = True
) -> CostModel | None:
    """The cost model the planner predicts with: a file, this host's saved one, a profile
    run now (only when a feature needs it and none is saved), or none."""
    from pdserve.costmodel import profile

    if args.cost_model == "none":
        if _needs_cost_model(args):
            raise ValueError("SLO admission, --autobalance and conditional disaggregation need "
                             "a cost model; drop --cost-model none")  # fmt: skip
        return None
    if args.cost_model != "auto":
        return CostModel.load(Path(args.cost_model))
    path = _default_cost_path(args, model, threads)
    if path.is_file() or (may_profile and _needs_cost_model(args)):
        settings = _cost_engine_args(args, model)
        return profile.load_or_profile(
            model,
            threads,
            path,
            quantization=settings["quantization"],
            kv_cache_dtype=settings["kv_cache_dtype"],
            decode_matmul=settings["decode_matmul"],
            prefill_format=settings["prefill_format"],
        )
    if _needs_cost_model(args):
        raise ValueError(profile.missing_profile(path, threads))
    return None


def _cost_engine_args(args: argparse.Namespace, model: str | None) -> dict[str, str]:
    """The engine settings a cost model is measured for (and named after): the quantization
    the workers will run (`auto` resolved for this model, as their engines resolve it)."""
    from pdserve.engine.quantize import resolve_quantization

    quantization = resolve_quantization(
        getattr(args, "quantization", None) or "auto",
        model,
        getattr(args, "device", None) or "cpu",
        getattr(args, "dtype", None) or "float32",
    )
    from pdserve.engine.prefill_format import resolved

    prefill = getattr(args, "prefill_format", None) or "auto"
    return {
        "quantization": quantization,
        "kv_cache_dtype": getattr(args, "kv_cache_dtype", None) or "auto",
        "decode_matmul": getattr(args, "decode_matmul", None) or "auto",
        "prefill_format": resolved(
            prefill, quantization, getattr(args, "dtype", None) or "float32"
        ),
    }


def _default_cost_path(args: argparse.Namespace, model: str | None, threads: int) -> Path:
    """This host's cost model file for the workers' engine settings (what `_cost_model` loads
    and what stall-free workers are handed: the same file)."""
    from pdserve.costmodel import profile

    dtype = getattr(args, "dtype", None) or "float32"
    return profile.profile_path(model, threads, **_cost_engine_args(args, model), dtype=dtype)


def _planner(args: argparse.Namespace, cost: CostModel | None) -> SloPlanner | None:
    if cost is None:
        return None
    mode = "always" if args.disaggregation == "always" else "conditional"
    return SloPlanner(
        cost,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
        admission=args.admission,
        mode=mode,
        token_budget=getattr(args, "max_num_batched_tokens", None) or 2048,
        expected_output=args.expected_output,
        pool_bytes_per_s=getattr(args, "kv_pool_gbps", 1.0) * 1e9,
    )


def _use_secret(args: argparse.Namespace, endpoints: list[str]) -> None:
    """Load the shared secret, refuse to run without one off loopback, tag our messages, and
    hand it to the workers we start (through their environment, never their command line)."""
    secret = auth.load_secret(args.secret_file)
    auth.require_secret(endpoints, secret)
    m.set_key(secret)
    if secret is not None:
        os.environb[auth.ENV.encode()] = secret


def run_serve(args: argparse.Namespace) -> int:
    if getattr(args, "ray", None) is not None:
        from pdserve.ray import launch as ray_launch

        return ray_launch.run(args)
    _setup_logging()
    specs = _worker_specs(args)
    _use_secret(args, [s.config.host for s in specs])
    # before the workers start: profiling (when needed) measures a quiet machine
    threads = int(specs[0].engine_args["threads"])
    cost = _cost_model(args, args.model, threads)
    specs = _with_stall_free(args, specs, cost, threads)
    ctx = zmq.Context()
    workers: list[Launched] = []
    try:
        t0 = time.monotonic()
        workers = [launch(s, ctx) for s in specs]
        for w in workers:
            await_ready(w, t0 + STARTUP_TIMEOUT_S)
        log.info("%d workers ready in %.1fs", len(workers), time.monotonic() - t0)
        supervised = workers if args.restart_workers else None
        endpoints = [w.control for w in workers]
        return asyncio.run(_serve_router(endpoints, args, args.model, supervised, ctx, cost))
    finally:
        _shutdown(ctx, workers)


def run_router(args: argparse.Namespace) -> int:
    _setup_logging()
    endpoints = [*args.prefill, *args.decode, *args.colocated]
    if not endpoints:
        raise ValueError("give worker URLs: --prefill URL... --decode URL... or --colocated URL...")
    _use_secret(args, endpoints)
    cost = _cost_model(args, args.model, 1, may_profile=False)
    return asyncio.run(_serve_router(endpoints, args, args.model, cost_model=cost))


async def _supervise(workers: list[Launched], ctx: zmq.Context, core: Any) -> None:
    """Restart a worker process that exited, on its old addresses, so the router's sockets
    reconnect and the heartbeats bring it back into routing (issue 7: recovery)."""
    while True:
        await asyncio.sleep(1.0)
        for i, w in enumerate(workers):
            if w.proc is None or w.proc.poll() is None or not w.control.startswith("tcp://"):
                continue
            log.warning("worker %s exited (%s); restarting it", w.spec.worker_id, w.proc.returncode)
            core.counters["workers_restarted"] += 1
            fresh = relaunch(w, ctx)
            try:
                await asyncio.to_thread(await_ready, fresh, time.monotonic() + STARTUP_TIMEOUT_S)
            except Exception as e:  # keep supervising the others; try this one again later
                log.error("worker %s did not come back: %s", w.spec.worker_id, e)
            workers[i] = fresh


async def _serve_router(
    endpoints: list[str],
    args: argparse.Namespace,
    model: str | None,
    supervised: list[Launched] | None = None,
    ctx: zmq.Context | None = None,
    cost_model: CostModel | None = None,
    pools: Any = None,
) -> int:
    """The router in front of `endpoints`; `supervised` workers are restarted when they exit;
    `pools` (pdserve.ray.pools.RayPools) supervises and resizes Ray worker actors instead."""
    import uvicorn

    from pdserve.metrics.prometheus import Metrics
    from pdserve.router.app import create_app
    from pdserve.router.balancer import Autobalancer
    from pdserve.router.core import RouterCore

    metrics = Metrics(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
    planner = _planner(args, cost_model)
    core = RouterCore(
        endpoints,
        config_from_args(RouterConfig, args),
        metrics=metrics,
        planner=planner,
        autobalancer=Autobalancer() if args.autobalance else None,
    )
    await core.start()
    if pools is not None:
        await pools.attach(core)
    supervisor = None
    if supervised is not None and ctx is not None:
        supervisor = asyncio.create_task(_supervise(supervised, ctx, core))
    try:
        source = loader.resolve_model(model or core.model or None)
        # off the event loop: a GGUF tokenizer takes seconds to build, and the heartbeats that
        # keep the workers in routing are answered on this loop
        tokenizer = await asyncio.to_thread(loader.load_tokenizer, source)
        arch = await asyncio.to_thread(loader.load_arch, source)
        name = args.served_model_name or Path(source.path).name.removesuffix(".gguf")
        app = create_app(
            core,
            tokenizer,
            model_name=name,
            api_key=args.api_key,
            max_model_len=arch.max_position_embeddings,
            metrics=metrics,
            scaler=pools,
        )
        _warn_if_exposed(args.host, args.api_key)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=int(args.drain),
        )
        server = _server_class()(config)
        print(
            f"pdserve: serving {name} at http://{args.host}:{args.port}/v1 "
            f"({len(endpoints)} workers)",
            flush=True,
        )
        await server.serve()
    finally:
        if supervisor is not None:
            supervisor.cancel()
        if pools is not None:
            await pools.close()
        await core.close()
    return 0


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after a graceful shutdown (exit status -15); a drained
        shutdown here is a success, so the signal only starts the drain."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    return Server


def _warn_if_exposed(host: str, api_key: str | None) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not api_key:
        log.warning(
            "the router listens on %s without --api-key: anyone who can reach it can use it", host
        )


def _shutdown(ctx: zmq.Context, workers: list[Launched]) -> None:
    for w in workers:
        if not w.control:
            continue
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(w.control)
        sock.send(m.encode(m.Shutdown()))
        sock.close()
    for w in workers:
        if w.proc is not None and not w.control:
            w.proc.terminate()
        stop(w)
    ctx.term()


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
