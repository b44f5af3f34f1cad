"""The composition root: from a `Deployment` to the worker specs, the cost model, the planner and
the router core that every front (local processes, Ray actors, HTTP) runs.

    specs  = worker_specs(d)                  # one WorkerSpec per worker, engine args checked
    cost   = cost_model(d, threads)           # a file, this host's saved one, a profile, or None
    d, cost = at_host_level(d, cost, threads) # --level-probe: rescaled to the host's speed now
    specs  = with_stall_free(d, specs, ...)   # decode workers get the TPOT SLO and the file
    core   = router_core(d, endpoints, cost)  # RouterCore with the planner and autobalancer
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import zmq

from pdserve.costmodel.model import CostModel
from pdserve.deployment import Deployment
from pdserve.launcher import WorkerSpec
from pdserve.router.core import RouterCore
from pdserve.router.slo import CALIBRATION_PROBES, SloPlanner
from pdserve.router.threads import ThreadPolicy
from pdserve.workers import auth
from pdserve.workers import messages as m

log = logging.getLogger("pdserve.serve")
STARTUP_TIMEOUT_S = 300.0


def worker_specs(d: Deployment, threads: int | None = None) -> list[WorkerSpec]:
    """One spec per worker of the topology: ids P0, P1, D0, ..., C0, in role order."""
    return [
        WorkerSpec(role, f"{role[0].upper()}{i}", d.engine_args(role, threads), d.worker)
        for role, n in d.topology.counts().items()
        for i in range(n)
    ]


def cost_model(d: Deployment, threads: int, may_profile: bool = True) -> CostModel | None:
    """The cost model the planner predicts with: a file, this host's saved one, a profile
    run now (only when a feature needs it and none is saved), or none."""
    from pdserve.costmodel import profile

    name = d.planner.cost_model
    if name == "none":
        if d.planner.needs_cost_model():
            raise ValueError("SLO admission, --autobalance and conditional disaggregation need "
                             "a cost model; drop --cost-model none")  # fmt: skip
        return None
    if name != "auto":
        return CostModel.load(Path(name))
    path = cost_path(d, threads)
    if path.is_file() or (may_profile and d.planner.needs_cost_model()):
        settings: dict[str, Any] = dict(cost_settings(d))
        return profile.load_or_profile(d.model, threads, path, **settings)
    if d.planner.needs_cost_model():
        raise ValueError(profile.missing_profile(path, threads))
    return None


def cost_settings(d: Deployment) -> dict[str, str]:
    """The engine settings a cost model is measured for (and named after): the quantization
    the workers will run (`auto` resolved for this model, as their engines resolve it)."""
    from pdserve.engine.prefill_format import resolved
    from pdserve.engine.quantize import resolve_quantization

    dtype = d.setting("dtype", "float32")
    quantization = resolve_quantization(
        d.setting("quantization", "auto"), d.model, d.setting("device", "cpu"), dtype
    )
    return {
        "quantization": quantization,
        "kv_cache_dtype": d.setting("kv_cache_dtype", "auto"),
        "decode_matmul": d.setting("decode_matmul", "auto"),
        "prefill_format": resolved(d.setting("prefill_format", "auto"), quantization, dtype),
    }


def at_host_level(
    d: Deployment, cost: CostModel | None, threads: int
) -> tuple[Deployment, CostModel | None]:
    """`--level-probe`: the cost model rescaled to the speed this host runs the workers' engine
    now (costmodel/host_level.py), saved to a file of this server's that the deployment then
    names, so the planner and the stall-free workers price the same steps."""
    if not d.planner.level_probe or cost is None:
        return d, cost
    from pdserve.costmodel import host_level

    path = cost_path(d, threads)
    level = host_level.measure(path, d.model, threads, cost_settings(d))
    levelled = cost.rescaled(level.prefill_x, level.decode_x)
    out = Path(tempfile.gettempdir()) / f"pdserve-level-{os.getpid()}-{path.name}"
    host_level.save_rescaled(path, levelled, out, level=level.as_dict(), levelled=str(path))
    log.info(
        "host level: prefill x%.2f, decode x%.2f against %s (probe %.0f s); planning with %s",
        level.prefill_x, level.decode_x, path, level.seconds, out,
    )  # fmt: skip
    planner = dataclasses.replace(d.planner, cost_model=str(out))
    return dataclasses.replace(d, planner=planner), levelled


def cost_path(d: Deployment, threads: int) -> Path:
    """The cost model file `cost_model` loads and stall-free workers are handed (one file):
    an explicit path, else this host's for the workers' engine settings."""
    if d.planner.cost_model not in ("auto", "none"):
        return Path(d.planner.cost_model)
    from pdserve.costmodel import profile

    return profile.profile_path(
        d.model,
        threads,
        **cost_settings(d),
        dtype=d.setting("dtype", "float32"),
        device=d.setting("device", "cpu"),
    )


def with_stall_free(
    d: Deployment, specs: list[WorkerSpec], cost: CostModel | None, threads: int
) -> list[WorkerSpec]:
    """Hand the TPOT SLO and the cost model file to the workers that run decodes."""
    tpot = d.planner.slo_tpot_s
    if not d.planner.stall_free or tpot is None or cost is None:
        return specs
    path = str(cost_path(d, threads))
    return [
        dataclasses.replace(
            s, config=dataclasses.replace(s.config, slo_tpot_s=tpot, cost_model=path)
        )
        if s.role in ("colocated", "decode")
        else s
        for s in specs
    ]


def planner(d: Deployment, cost: CostModel | None) -> SloPlanner | None:
    if cost is None:
        return None
    p = d.planner
    return SloPlanner(
        cost,
        slo_ttft_s=p.slo_ttft_s,
        slo_tpot_s=p.slo_tpot_s,
        admission=p.admission,
        mode=p.disaggregation if p.disaggregation in ("always", "overflow") else "conditional",
        token_budget=d.setting("max_num_batched_tokens", 2048),
        expected_output=p.expected_output,
        pool_bytes_per_s=p.kv_pool_gbps * 1e9,
        calibration_probes=CALIBRATION_PROBES if p.adaptive else 0,
    )


def router_core(
    d: Deployment,
    endpoints: list[str],
    cost: CostModel | None,
    ctx: zmq.Context | None = None,
    **core_args: Any,
) -> RouterCore:
    """The router core in front of `endpoints`, with the deployment's planner (when there is a
    cost model) and pool autobalancer; `core_args` (metrics, liveness timeouts ...) pass on."""
    from pdserve.router.balancer import Autobalancer

    core_args.setdefault("planner", planner(d, cost))
    if d.planner.autobalance:
        core_args.setdefault("autobalancer", Autobalancer())
    if d.planner.adaptive:
        core_args.setdefault("thread_policy", thread_policy(d))
    return RouterCore(endpoints, d.router, ctx=ctx, **core_args)


def thread_policy(d: Deployment) -> ThreadPolicy:
    """`--adaptive`'s thread policy over the host's cores, and the start-up line saying what
    the mode composed."""
    cores, p = d.topology.host_cores(), d.planner
    policy = ThreadPolicy(
        cores=cores,
        profiled_threads=d.topology.worker_threads(),
        grain_tokens=p.adaptive_grain,
    )
    log.info(
        "adaptive: 1 prefill + 1 decode worker sharing %d cores (threads move between them, "
        "starting %d + %d); stall-free decode within TPOT %gs; D prefills when P would break "
        "TTFT %gs (disaggregation %s)",
        cores, policy.p_cores, cores - (policy.p_cores or 0), p.slo_tpot_s, p.slo_ttft_s,
        p.disaggregation,
    )  # fmt: skip
    return policy


def use_secret(d: Deployment, endpoints: list[str]) -> bytes | None:
    """Load the shared secret, refuse to run without one off loopback, tag our messages, and
    hand it to the workers we start (through their environment, never their command line)."""
    secret = auth.load_secret(d.http.secret_file)
    auth.require_secret(endpoints, secret)
    m.set_key(secret)
    if secret is not None:
        os.environb[auth.ENV.encode()] = secret
    return secret


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
