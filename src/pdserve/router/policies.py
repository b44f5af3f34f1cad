"""Routing policies, chosen from a registry by name: which worker of a pool takes a request.

A policy sees only plain worker views (id, outstanding requests, last reported queue), so it is
tested without sockets; `least_outstanding` is the default for both the P and the D pool.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass
class WorkerLoad:
    worker_id: str
    outstanding: int  # requests this router sent there and has not seen finish
    waiting: int = 0  # the worker's own queue, from its last stats


class Policy(Protocol):
    def pick(self, pool: Sequence[WorkerLoad]) -> WorkerLoad: ...


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, pool: Sequence[WorkerLoad]) -> WorkerLoad:
        return pool[next(self._turn) % len(pool)]


class LeastOutstanding:
    """Fewest requests in flight (ties: shorter queue, then id), so load spreads at once."""

    def pick(self, pool: Sequence[WorkerLoad]) -> WorkerLoad:
        return min(pool, key=lambda w: (w.outstanding, w.waiting, w.worker_id))


POLICIES: dict[str, type] = {"round_robin": RoundRobin, "least_outstanding": LeastOutstanding}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()  # type: ignore[no-any-return]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
