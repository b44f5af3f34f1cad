"""`Deployment`: one description of a pdserve deployment, whoever runs it.

A deployment is its topology (how many P, D and colocated workers, threads each), what every
worker runs (model, engine settings, per-role overrides, `WorkerConfig`), the router's knobs
(`RouterConfig`), the planner's (`PlannerConfig`), the HTTP front's (`HttpConfig`) and, to run
on Ray, `RayConfig`. It is built once, from the command line (`from_args`), a YAML file
(`from_yaml`, `pdserve serve --config deploy.yaml`) or Python, and handed to `pdserve serve`
(serve/), `LocalCluster` (cluster.py), the Ray launcher (serve/ray.py) and the simulator
(`sim.deploy.Deployment.of`). The YAML file has the sections of this class:

    model: /models/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf
    topology: {prefill: 1, decode: 2, threads: 2}
    engine: {kv_cache_memory_gb: 2}
    roles: {decode: {max_num_seqs: 128}}
    worker: {transport: tcp, kv_codec: int8}
    planner: {slo_ttft_s: 1.0, slo_tpot_s: 0.1}
    http: {port: 8000}
    ray: {address: auto, cpus_per_worker: 0.5}

Validation raises `ValueError` naming the section and the key to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.config import KV_POOL_FIELDS, EngineConfig, RouterConfig, WorkerConfig

ROLES = ("prefill", "decode", "colocated")
# Engine settings `pdserve serve` takes as flags and passes to every worker: a new one is its
# name here.
SERVE_ENGINE_ARGS = (
    "block_size",
    "conversation_ttl",
    "decode_matmul",
    "kv_cache_memory_gb",
    "kv_cache_dtype",
    "max_num_batched_tokens",
    "prefill_format",
    "quantization",
    "speculative_config",
)
DISAGGREGATIONS = ("auto", "conditional", "always", "overflow")
# `--adaptive` without SLOs: the tighter of the RAG-small SLO sets of issue 45 for TTFT, a reading
# pace for TPOT (10 tokens/s)
ADAPTIVE_SLO_TTFT_S, ADAPTIVE_SLO_TPOT_S = 2.0, 0.1
# `--adaptive`: D's step budget, and P's while it is short of the host's cores (the thread
# policy's `grain_tokens`; with every core P runs the shared budget). A new thread count applies
# from a worker's next step, so a whole 900-token prompt in one step kept the count it started
# with (one of two cores) after D went idle; at 256 tokens a move reaches P within ~0.3 s
ADAPTIVE_PREFILL_CHUNK = 256


@dataclass(frozen=True)
class Topology:
    """How many workers of each role, and the torch threads each gets."""

    prefill: int | None = None  # None: 1, or 0 beside colocated workers
    decode: int | None = None
    colocated: int = 0
    threads: int | None = None  # None: this machine's cores / workers
    cores: int | None = None  # the cores the workers share (adaptive moves threads within them)

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):  # resolved once, so every reader sees numbers
            if getattr(self, role) is None:
                object.__setattr__(self, role, 0 if self.colocated else 1)
        n = self.counts()
        if min(n.values()) < 0:
            raise ValueError("topology: prefill, decode and colocated must be >= 0")
        if n["colocated"] == 0 and (n["prefill"] < 1 or n["decode"] < 1):
            raise ValueError(
                "topology: give at least one prefill and one decode worker, or colocated > 0"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"topology: threads must be >= 1, got {self.threads}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"topology: cores must be >= 1, got {self.cores}")

    def counts(self) -> dict[str, int]:
        """Workers per role, roles without any included."""
        return {
            "prefill": self.prefill or 0,
            "decode": self.decode or 0,
            "colocated": self.colocated,
        }

    @property
    def workers(self) -> int:
        return sum(self.counts().values())

    def worker_threads(self, cores: int | None = None) -> int:
        """Threads per worker: as given, else the machine's cores shared out (at least 1)."""
        if self.threads is not None:
            return self.threads
        return max(1, (cores or self.host_cores()) // self.workers)

    def host_cores(self) -> int:
        """`cores` as given, else the cores this process may run on."""
        return self.cores or len(os.sched_getaffinity(0)) or os.cpu_count() or 1


@dataclass(frozen=True)
class PlannerConfig:
    """The router's SLO planner: admission, conditional disaggregation, pool autobalancing."""

    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    admission: bool = True  # with an SLO: reject (429) requests predicted to miss it
    cost_model: str = "auto"  # a JSON path | auto (this host's, profiled if needed) | none
    disaggregation: str = "auto"  # auto | conditional | always
    autobalance: bool = False  # move workers between the pools when one saturates
    expected_output: int = 256  # tokens assumed generated when max_tokens is larger
    kv_pool_gbps: float = 1.0  # first guess of a worker's KV pool load speed, GB/s
    stall_free: bool = True  # with slo_tpot_s: decode workers size prompt chunks to it
    # 1P1D whose threads move between P and D, D prefilling under bursts (`Deployment.adapted`)
    adaptive: bool = False
    # time a few steps at start-up and plan with the cost model at this host's speed now
    # (costmodel/host_level.py; serve/plan.py `at_host_level`)
    level_probe: bool = False
    # adaptive: P's step cap in prompt tokens while it is short of the host's cores (the
    # thread policy's `grain_tokens`): a thread move reaches a prompt under way within a step
    adaptive_grain: int = ADAPTIVE_PREFILL_CHUNK

    def __post_init__(self) -> None:
        if self.disaggregation not in DISAGGREGATIONS:
            raise ValueError(
                f"planner: disaggregation must be one of {', '.join(DISAGGREGATIONS)}, "
                f"got {self.disaggregation!r}"
            )
        for name in ("slo_ttft_s", "slo_tpot_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"planner: {name} must be > 0 seconds, got {value}")
        if self.expected_output < 1:
            raise ValueError("planner: expected_output must be >= 1")
        if self.adaptive_grain < 1:
            raise ValueError(f"planner: adaptive_grain must be >= 1, got {self.adaptive_grain}")

    @property
    def has_slo(self) -> bool:
        return self.slo_ttft_s is not None or self.slo_tpot_s is not None

    def needs_cost_model(self) -> bool:
        """Whether a feature asked for cannot work without one."""
        admits = self.has_slo and self.admission
        conditional = self.disaggregation in ("conditional", "overflow")
        return admits or self.autobalance or conditional or self.adaptive


@dataclass(frozen=True)
class HttpConfig:
    """The OpenAI-compatible HTTP front (uvicorn) and the shared secret of the control plane."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    drain_s: float = 30.0  # in-flight requests' time to finish at shutdown
    secret_file: str | None = None  # else $PDSERVE_SECRET


@dataclass(frozen=True)
class RayConfig:
    """Run every worker as a Ray actor (serve/ray.py); the router stays in this process."""

    address: str = "auto"  # auto: start Ray here; else a cluster address
    cpus_per_worker: float | None = None  # None: with auto, cores / workers; else 1
    max_restarts: int = -1  # times Ray restarts a dead worker actor (-1: always)
    dashboard: bool = False  # Ray's own dashboard, with auto

    def __post_init__(self) -> None:
        if not self.address.strip():
            raise ValueError("ray: address needs 'auto' or a cluster address (ray://host:10001)")
        if self.cpus_per_worker is not None and not self.cpus_per_worker > 0:
            raise ValueError(f"ray: cpus_per_worker must be > 0, got {self.cpus_per_worker}")

    @property
    def local(self) -> bool:
        return self.address.strip() == "auto"

    def worker_cpus(self, workers: int, cores: int | None = None) -> float:
        """Ray CPUs one worker actor reserves."""
        if self.cpus_per_worker is not None:
            return self.cpus_per_worker
        return max(1, (cores or os.cpu_count() or 1) // workers) if self.local else 1


def adapted(p: PlannerConfig, t: Topology, ray: RayConfig | None) -> PlannerConfig:
    """`adaptive`'s planner: the SLOs given or ADAPTIVE_SLO_*, D prefilling only under bursts
    (disaggregation `overflow`), stall-free D. Refuses what it cannot compose with."""
    if t.colocated or t.prefill != 1 or t.decode != 1:
        raise ValueError("planner: adaptive runs one prefill and one decode worker (drop "
                         "--prefill/--decode/--colocated)")  # fmt: skip
    if p.autobalance or ray is not None:
        raise ValueError("planner: adaptive moves threads on one host; drop --autobalance/--ray")
    if p.cost_model == "none" or not p.stall_free:
        raise ValueError("planner: adaptive needs a cost model and stall-free batching")
    return dataclasses.replace(
        p,
        slo_ttft_s=p.slo_ttft_s or ADAPTIVE_SLO_TTFT_S,
        slo_tpot_s=p.slo_tpot_s or ADAPTIVE_SLO_TPOT_S,
        disaggregation="overflow" if p.disaggregation == "auto" else p.disaggregation,
    )


def chunked_prefill(
    roles: dict[str, dict[str, Any]], engine: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """`adaptive`'s role override: D's steps at most ADAPTIVE_PREFILL_CHUNK tokens, unless the
    role sets its own budget (a smaller shared one stays). D's stall-free budget sizes its
    chunks beside decodes; with none running it took a whole prompt in one step (a 2000-token
    one: 5 s without reading a message, a hold among them). P keeps the shared budget: the
    thread mover caps its steps while it is short of cores (`SetThreads.step_tokens`)."""
    shared = engine.get("max_num_batched_tokens")
    own = roles.get("decode", {})
    if "max_num_batched_tokens" in own:
        return roles
    budget = min(shared or ADAPTIVE_PREFILL_CHUNK, ADAPTIVE_PREFILL_CHUNK)
    return {**roles, "decode": {**own, "max_num_batched_tokens": budget}}


def threads_for_cpus(cpus: float) -> int:
    """Torch threads of a worker holding `cpus` (Ray's logical CPUs): the whole CPUs, and one
    when it holds less than one (it then shares a core with another worker)."""
    return max(1, math.floor(cpus))


@dataclass(frozen=True)
class Deployment:
    model: str | None = None  # HF folder or .gguf; None: the default model
    topology: Topology = field(default_factory=Topology)
    engine: dict[str, Any] = field(default_factory=dict)  # engine arguments every worker gets
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)  # role -> engine overrides
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    ray: RayConfig | None = None  # None: worker processes on this machine
    restart_workers: bool = True  # restart a worker process that exits (not under Ray)

    def __post_init__(self) -> None:
        if self.planner.adaptive:
            if self.worker.transport == "inproc":  # torch's thread count is per process
                raise ValueError("worker: adaptive moves threads between worker processes; "
                                 "use transport tcp, ipc or shm")  # fmt: skip
            object.__setattr__(self, "planner", adapted(self.planner, self.topology, self.ray))
            object.__setattr__(self, "roles", chunked_prefill(self.roles, self.engine))
            # P sends a prompt's KV after it, not layer by layer: D's receive would run on the
            # cores P computes on (a lone 2000-token prompt, paired: 0.94x / 0.99x streamed)
            object.__setattr__(self, "worker", dataclasses.replace(self.worker, stream_kv=False))
        for role, overrides in self.roles.items():
            if role not in ROLES:
                raise ValueError(f"roles: {role!r} is not one of {', '.join(ROLES)}")
            EngineConfig.from_kwargs(**{**self.engine, **overrides})
        EngineConfig.from_kwargs(**self.engine)  # a bad value: one ValueError before any start

    def engine_args(self, role: str, threads: int | None = None) -> dict[str, Any]:
        """A `role` worker's engine arguments (model and threads included)."""
        threads = self.topology.worker_threads() if threads is None else threads
        model = {"model": self.model} if self.model is not None else {}
        return {"threads": threads, **model, **self.engine, **self.roles.get(role, {})}

    def setting(self, name: str, default: Any = None) -> Any:
        """An engine setting every worker shares, or `default` when none is set."""
        value = self.engine.get(name)
        return default if value is None else value

    # ---- constructors --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Deployment:
        """From the YAML file's shape: sections of keyword arguments (unknown keys refused)."""
        _known("deployment", data, {f.name for f in dataclasses.fields(cls)})
        sections: dict[str, Any] = {k: v for k, v in data.items() if k not in _SECTIONS}
        for name, kind in _SECTIONS.items():
            if data.get(name) is not None:
                sections[name] = _section(name, kind, data[name])
        return cls(**sections)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Deployment:
        return cls.from_dict(load_yaml(path))

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Deployment:
        """From `pdserve serve`'s flags (serve/flags.py names each after its field here)."""
        return cls.from_dict(args_dict(ns))

    def to_dict(self) -> dict[str, Any]:
        """The YAML file's shape (`from_dict(d.to_dict()) == d`)."""
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type] = {
    "topology": Topology,
    "worker": WorkerConfig,
    "router": RouterConfig,
    "planner": PlannerConfig,
    "http": HttpConfig,
    "ray": RayConfig,
}


def _known(where: str, data: Mapping[str, Any], names: set[str]) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping of keys, got {type(data).__name__}")
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; accepted: {', '.join(sorted(names))}")


def _section(name: str, kind: type, data: Mapping[str, Any]) -> Any:
    _known(name, data, {f.name for f in dataclasses.fields(kind)})
    return kind(**data)


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a deployment file is a mapping of sections")
    return data


# ---- the command line's namespace --------------------------------------------------------------
# Flags named after the fields of each section (`--slo-ttft` is planner.slo_ttft_s); ray's
# flags carry a `ray_` prefix, `--ray` itself is ray.address.
_PLANNER = tuple(f.name for f in dataclasses.fields(PlannerConfig))
_HTTP = tuple(f.name for f in dataclasses.fields(HttpConfig))
_WORKER = ("transport", "kv_codec", "deadline_s", *KV_POOL_FIELDS)


def args_dict(ns: argparse.Namespace, only: set[str] | None = None) -> dict[str, Any]:
    """The deployment a parsed `pdserve serve` namespace describes, in the YAML file's shape;
    `only`: just these namespace names (the flags given on the command line)."""
    given = vars(ns) if only is None else {k: v for k, v in vars(ns).items() if k in only}
    router = {f.name for f in dataclasses.fields(RouterConfig) if f.metadata.get("cli", True)}
    out: dict[str, Any] = {
        "topology": _topology(given),
        "engine": {k: given[k] for k in SERVE_ENGINE_ARGS if given.get(k) is not None},
        "worker": {k: given[k] for k in _WORKER if k in given},
        "router": {k: given[k] for k in router if k in given},
        "planner": {k: given[k] for k in _PLANNER if k in given},
        "http": {k: given[k] for k in _HTTP if k in given},
    }
    if "model" in given:
        out["model"] = given["model"]
    if "restart_workers" in given:
        out["restart_workers"] = given["restart_workers"]
    if given.get("ray_address") is not None:
        ray_fields = (f.name for f in dataclasses.fields(RayConfig))
        out["ray"] = {f: given[f"ray_{f}"] for f in ray_fields if f"ray_{f}" in given}
    return {k: v for k, v in out.items() if v != {}}


def _topology(given: Mapping[str, Any]) -> dict[str, Any]:
    colocated, prefill, decode = (given.get(k) for k in ("colocated", "prefill", "decode"))
    if colocated and (prefill or decode):
        raise ValueError("give either --colocated N or --prefill N --decode M, not both")
    names = ("prefill", "decode", "colocated", "threads", "cores")
    return {k: given[k] for k in names if given.get(k) is not None}
