"""The command line's edge: `pdserve serve` and `pdserve router` flags, read into a `Deployment`.

Every flag's destination is the name of its `Deployment` field (deployment.py: `--slo-ttft` is
`planner.slo_ttft_s`, `--ray-cpus-per-worker` is `ray.cpus_per_worker`), so the namespace stops
here: `deployment(ns)` is the last code that sees it. `pdserve serve --config deploy.yaml` reads
the file first; flags given on the command line then override its values.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from pdserve.argtypes import positive_int
from pdserve.config import (
    KV_POOL_FIELDS,
    RouterConfig,
    WorkerConfig,
    add_config_args,
    add_engine_overrides,
)
from pdserve.deployment import (
    ADAPTIVE_PREFILL_CHUNK,
    SERVE_ENGINE_ARGS,
    Deployment,
    args_dict,
    load_yaml,
)

TOPOLOGY_FLAGS = ("prefill", "decode", "colocated")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, RouterConfig)
    a = parser.add_argument
    a(
        "--secret-file",
        default=None,
        help="shared secret authenticating control messages (else "
        "$PDSERVE_SECRET); required when workers are not on loopback",
    )
    a("--host", default="127.0.0.1", help="router address (loopback)")
    a("--port", type=int, default=8000, help="router port")
    a(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (or set PDSERVE_API_KEY)",
    )
    a("--served-model-name", default=None, help="model id in the API")
    a(
        "--drain",
        dest="drain_s",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish at shutdown",
    )
    add_planner_arguments(parser)


def add_planner_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--slo-ttft", dest="slo_ttft_s", type=float, default=None, help="TTFT SLO, seconds")
    a("--slo-tpot", dest="slo_tpot_s", type=float, default=None, help="TPOT SLO, seconds")
    a(
        "--admission",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with an SLO set, reject (429 + Retry-After) requests predicted to miss it",
    )
    a(
        "--cost-model",
        default="auto",
        help="cost model JSON (pdserve bench profile); 'auto': "
        "this host's saved one, profiled at start-up when SLOs, --autobalance or "
        "--disaggregation conditional need it; 'none'",
    )
    a(
        "--disaggregation",
        choices=("auto", "conditional", "always", "overflow"),
        default="auto",
        help="conditional: per request, prefill on P or locally on D, whichever the cost model "
        "predicts better; always: every request through P; overflow: through P unless P's "
        "queue would break the TTFT SLO and D has TPOT slack (a burst); auto: conditional with "
        "a cost model (overflow with --adaptive)",
    )
    a(
        "--autobalance",
        action="store_true",
        help="move workers between the prefill and "
        "decode pools when one stays saturated while the other idles",
    )
    a(
        "--expected-output",
        type=int,
        default=256,
        help="tokens the planner assumes a request generates when max_tokens is larger",
    )
    a(
        "--kv-pool-gbps",
        type=float,
        default=1.0,
        help="the planner's first guess of how fast a "
        "worker loads KV from its pool, GB/s (`pdserve bench kvpool`'s get GB/s for the tier); "
        "each worker's loads then replace it",
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "model",
        nargs="?",
        default=None,
        help="HF folder or .gguf file; default: SmolLM2-135M-Instruct",
    )
    a(
        "--config",
        default=None,
        metavar="YAML",
        help="a deployment file (docs/reference.md, "
        "'Deployment files'); flags given beside it override its values",
    )
    a("--prefill", type=int, default=None, help="prefill workers (default 1)")
    a("--decode", type=int, default=None, help="decode workers (default 1)")
    a("--colocated", type=int, default=0, help="colocated workers instead of P/D pools")
    a("--transport", default="tcp", help="KV transport: tcp | ipc | shm")
    a("--kv-codec", default="none", help="KV wire codec: none | int8 | int4")
    a(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker; default: cores / workers",
    )
    a(
        "--cores",
        type=int,
        default=None,
        help="cores the workers share (with --adaptive: the threads moved between P and D); "
        "default: the cores this process may run on",
    )
    a(
        "--adaptive",
        action="store_true",
        help="one prefill and one decode worker on this host's cores, whose threads move to "
        "the side the load needs (router/threads.py), stall-free batching on D, and D "
        "prefilling prompts only when P's queue would break the TTFT SLO; SLOs not given "
        "default to --slo-ttft 2 --slo-tpot 0.1",
    )
    a(
        "--adaptive-grain",
        type=positive_int,
        default=ADAPTIVE_PREFILL_CHUNK,
        metavar="TOKENS",
        help="with --adaptive: P's step cap while it is short of the host's cores, so a thread "
        "move reaches a prompt under way within a step (longer steps waste less per token)",
    )
    add_engine_overrides(parser, SERVE_ENGINE_ARGS)
    # --kv-pool-*: WorkerConfig's pool fields, handed to every worker
    others = tuple(f.name for f in dataclasses.fields(WorkerConfig) if f.name not in KV_POOL_FIELDS)
    add_config_args(parser, WorkerConfig, skip=others)
    a(
        "--stall-free",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --slo-tpot and a cost model: colocated and decode workers size each step's "
        "prompt tokens so running decodes stay within the TPOT SLO (stall-free batching)",
    )
    a(
        "--level-probe",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="before the workers start, time a 512-token prompt and a decode batch against the "
        "cost model (~10 s) and plan with it rescaled to this host's speed now (a shared VM "
        "drifts from its profile by up to 2x)",
    )
    a(
        "--restart-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="restart a worker process that exits, on the same addresses",
    )
    add_ray_arguments(parser)
    add_common_arguments(parser)


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument_group("ray (serve/ray.py, pdserve/ray/)").add_argument
    a(
        "--ray",
        dest="ray_address",
        nargs="?",
        const="auto",
        default=None,
        metavar="auto|ADDRESS",
        help="run each worker as a Ray actor: 'auto' starts Ray on this "
        "machine, an address (ray://host:10001, host:6379) joins a cluster; Ray places (custom "
        "resources pdserve_prefill / pdserve_decode, else CPUs), restarts and resizes (POST "
        "/admin/pools) the workers; the router stays here",
    )
    a(
        "--ray-cpus-per-worker",
        type=float,
        default=None,
        help="Ray CPUs each worker actor reserves (default: with --ray auto, cores / workers; "
        "else 1); its torch threads are the whole CPUs, 1 below one CPU (the workers then share "
        "a core)",
    )
    a(
        "--ray-max-restarts",
        type=int,
        default=-1,
        help="times Ray restarts a dead worker actor (-1: always)",
    )
    a(
        "--ray-dashboard",
        action="store_true",
        help="start Ray's dashboard with --ray auto (off by default)",
    )


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--prefill", dest="prefill_urls", nargs="*", default=[], help="prefill worker control URLs")
    a("--decode", dest="decode_urls", nargs="*", default=[], help="decode worker control URLs")
    a("--colocated", dest="colocated_urls", nargs="*", default=[], help="colocated worker URLs")
    a("--model", default=None, help="for the tokenizer; default: the workers'")
    add_common_arguments(parser)


# ---- namespace -> Deployment ---------------------------------------------------------------------
def deployment(ns: argparse.Namespace) -> Deployment:
    """`pdserve serve`'s deployment: the flags, or the --config file under the flags given."""
    if getattr(ns, "config", None) is None:
        return Deployment.from_args(ns)
    given = _given(ns)
    data = _merge(args_dict(ns), load_yaml(ns.config))  # the flags' defaults under the file
    if given & set(TOPOLOGY_FLAGS):  # worker counts on the command line replace the file's
        topology = data.get("topology", {})
        data["topology"] = {k: v for k, v in topology.items() if k not in TOPOLOGY_FLAGS}
    return Deployment.from_dict(_merge(data, args_dict(ns, only=given)))


def router_deployment(ns: argparse.Namespace) -> tuple[Deployment, list[str]]:
    """`pdserve router`'s deployment (no workers of its own) and the worker URLs it fronts."""
    endpoints = [*ns.prefill_urls, *ns.decode_urls, *ns.colocated_urls]
    return Deployment.from_args(ns), endpoints


def _given(ns: argparse.Namespace) -> set[str]:
    """The flags the command line set: values other than the parser's defaults."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    defaults = vars(parser.parse_args([]))
    return {k for k, v in vars(ns).items() if k in defaults and v != defaults[k]}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, section by section."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out
