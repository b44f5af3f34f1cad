"""Why a worker actor is not up yet: Ray has not placed it, and the resource it waits for.

A new worker stays "starting" until its first `info()` answers: while it loads its model, or
for ever when no node has the CPUs (or the role's resource) it asks for. Ray's actor table tells
the two apart (PENDING_CREATION: not placed); the cluster's free resources say what is missing.
`ClusterView` is all `RayPools` asks Ray about placement, so tests give it a fake cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from pdserve.ray.placement import placement, shortfall

log = logging.getLogger("pdserve.ray")
# Ray's actor states before its creation task runs on a node.
UNPLACED = ("DEPENDENCIES_UNREADY", "PENDING_CREATION")


class ClusterView(Protocol):
    def cluster_resources(self) -> Mapping[str, float]: ...
    def available_resources(self) -> Mapping[str, float]: ...
    def actor_state(self, actor: Any) -> str | None:
        """Ray's state of the actor (PENDING_CREATION, ALIVE, ...); None when unknown."""
        ...


class RayView:
    """The connected Ray cluster."""

    def __init__(self, ray: Any) -> None:
        self.ray = ray

    def cluster_resources(self) -> Mapping[str, float]:
        resources: Mapping[str, float] = self.ray.cluster_resources()
        return resources

    def available_resources(self) -> Mapping[str, float]:
        resources: Mapping[str, float] = self.ray.available_resources()
        return resources

    def actor_state(self, actor: Any) -> str | None:
        # Ray's actor table (read from its control store, no dashboard needed) is a debugging
        # API without a stability promise: any failure means "unknown", never an error.
        try:
            from ray._private import state

            info = state.actors(actor._actor_id.hex())
            return str(info["State"]) if info else None
        except Exception:
            log.debug("actor state unavailable", exc_info=True)
            return None


def pending_reasons(
    starting: Iterable[tuple[str, str, Any]], view: ClusterView, cpus_per_worker: float
) -> list[dict[str, str]]:
    """For each (worker id, role, actor) Ray has not placed: its id, role and reason."""
    out: list[dict[str, str]] = []
    free: Mapping[str, float] | None = None
    for worker_id, role, actor in starting:
        if view.actor_state(actor) not in UNPLACED:
            continue  # placed (loading its model) or unknown: nothing to explain
        if free is None:
            free = view.available_resources()
        where = placement(role, view.cluster_resources(), cpus_per_worker)
        lack = shortfall(where, free)
        reason = lack or f"waits for Ray to place it (asks for CPU {float(where.num_cpus)})"
        out.append({"worker": worker_id, "role": role, "reason": f"pending: {reason}"})
    return out
