"""Where a worker actor may run: Ray's scheduling options for one P, D or colocated worker.

A cluster that names its pdserve nodes gives them custom resources (`ray start --resources
'{"pdserve_decode": 2}'` hosts up to two D workers); each worker actor then asks for one unit of
its role's resource and `cpus_per_worker` CPUs. A cluster without them places by CPUs alone.
All of Ray's resources are logical: the CPUs an actor asks for become its torch threads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.deployment import threads_for_cpus

RESOURCES = {
    "prefill": "pdserve_prefill",
    "decode": "pdserve_decode",
    "colocated": "pdserve_colocated",
}
MAX_POOL = 64  # workers per pool one /admin/pools call may ask for


@dataclass(frozen=True)
class Placement:
    num_cpus: float
    resources: dict[str, float] = field(default_factory=dict)

    def options(self) -> dict[str, Any]:
        """Keyword arguments of `ActorClass.options(...)`."""
        return {"num_cpus": self.num_cpus, "resources": dict(self.resources)}


def placement(role: str, cluster: Mapping[str, float], cpus_per_worker: float) -> Placement:
    """The role's custom resource when the cluster has any of it, else CPUs only."""
    if role not in RESOURCES:
        raise ValueError(f"role must be one of {', '.join(RESOURCES)}, got {role!r}")
    if cpus_per_worker <= 0:
        raise ValueError("cpus per worker must be > 0")
    name = RESOURCES[role]
    if cluster.get(name, 0) > 0:
        return Placement(cpus_per_worker, {name: 1.0})
    return Placement(cpus_per_worker)


def fits(p: Placement, available: Mapping[str, float]) -> bool:
    """Whether the cluster's free resources (summed over nodes) hold one more such worker: a
    hint (free CPUs may sit on a node without the role's resource), Ray decides for real."""
    if available.get("CPU", 0) < p.num_cpus:
        return False
    return all(available.get(k, 0) >= v for k, v in p.resources.items())


def shortfall(p: Placement, available: Mapping[str, float]) -> str | None:
    """What the cluster's free resources lack to hold one more such worker ("needs CPU 1.0,
    0 free"), or None when they hold it."""
    for name, need in (("CPU", p.num_cpus), *p.resources.items()):
        free = available.get(name, 0.0)
        if free < need:
            return f"needs {name} {float(need)}, {free:g} free"
    return None


def threads_for(assigned: Mapping[str, float]) -> int:
    """Torch threads of a worker from the CPUs Ray assigned to its actor (at least 1)."""
    return threads_for_cpus(assigned.get("CPU", 1))


def ray_address(value: str) -> str | None:
    """`--ray auto` starts Ray here (None for ray.init); anything else is a cluster address."""
    value = value.strip()
    if not value:
        raise ValueError("--ray needs 'auto' or a cluster address such as ray://host:10001")
    return None if value == "auto" else value
