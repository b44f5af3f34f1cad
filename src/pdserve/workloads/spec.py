"""LoadSpec: one run of the load generator (`pdserve bench serve`), as a value.

`bench serve`'s flags take their defaults from here and are read back with `from_args`;
`bench compare` and `bench sched` build a LoadSpec directly (`dataclasses.replace` for a
variation) instead of writing argv and re-parsing it. A workload's own settings (`--short-len`,
`--shift-at`, ...: the flags each workload registers in `workloads.WORKLOAD_ARGUMENTS`) travel
in `workload_args`, filled with those flags' defaults, and read as attributes like the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

THINK_DISTS = ("exponential", "fixed")


def check_think(think_time: float, think_dist: str) -> None:
    """The think-time settings `bench serve` and `pdserve sim` accept."""
    if not 0 <= think_time < float("inf") or think_dist not in THINK_DISTS:
        raise ValueError(
            f"think time must be finite and >= 0 and its distribution one of {THINK_DISTS}"
        )


def think_times(mean: float, dist: str, seed: int) -> Callable[[], float] | None:
    """Think time between turns: exponential with this mean (seeded) or fixed; None for 0.
    One draw per released turn, in the order turns finish (the simulator draws the same)."""
    if mean <= 0:
        return None
    if dist == "fixed":
        return lambda: mean
    rng = np.random.default_rng([seed, 7])
    return lambda: float(rng.exponential(mean))


def arrival_gaps(rate: float, burstiness: float, n: int, seed: int) -> list[float]:
    """Inter-arrival times (s): gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate.
    `bench serve` waits gap i before sending request i; `pdserve sim --bench-arrivals` replays
    the same times."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return [float(x) for x in rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)]


@dataclass(frozen=True)
class LoadSpec:
    url: str  # server base URL, e.g. http://127.0.0.1:8000
    num_requests: int
    rate: float | None = None  # requests/s (gamma arrivals); inf: all at once
    concurrency: int | None = None  # max requests in flight (instead of a rate)
    workload: str = "synthetic"
    burstiness: float = 1.0  # gamma shape of inter-arrival times (1: Poisson, <1: burstier)
    input_len: int = 1000  # mean prompt ids
    output_len: int = 128  # mean max_tokens
    len_spread: float = 0.0  # lengths uniform in mean*(1 +- spread)
    turns: int = 5  # turns per conversation (multiturn)
    slo_ttft: float | None = None  # seconds
    slo_tpot: float | None = None
    seed: int = 0
    model: str | None = None  # default: the first of GET /v1/models
    api_key: str | None = None
    ignore_eos: bool = True
    prompt_format: str = "ids"  # ids | text
    backend: str = "openai"  # how ignore_eos is asked for (serve_bench.BACKENDS)
    tokenizer: str | None = None  # sizes rag prompts, re-tokenizes multiturn answers
    timeout: float = 600.0  # per request, seconds
    no_progress: bool = False
    send_user: bool = True  # the conversation as the OpenAI `user` field
    think_time: float = 0.0  # seconds between a turn's answer and the next turn (mean)
    think_dist: str = "exponential"  # exponential | fixed
    workload_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of rate and concurrency")
        check_think(self.think_time, self.think_dist)
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        unknown = set(self.workload_args) - set(workload_defaults())
        if unknown:
            raise ValueError(f"unknown workload settings: {sorted(unknown)}")
        object.__setattr__(self, "workload_args", {**workload_defaults(), **self.workload_args})

    def __getattr__(self, name: str) -> Any:
        # only called for names that are not fields: a workload's own setting
        args = self.__dict__.get("workload_args", {})
        if name in args:
            return args[name]
        raise AttributeError(name)

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> LoadSpec:
        """The spec a `bench serve` command line describes."""
        names = {f.name for f in dataclasses.fields(cls)} - {"workload_args"}
        given = vars(ns)
        return cls(
            **{k: v for k, v in given.items() if k in names},
            workload_args={k: v for k, v in given.items() if k in workload_defaults()},
        )

    def but(self, **changes: Any) -> LoadSpec:
        """A copy with `changes`, fields or workload settings alike."""
        names = {f.name for f in dataclasses.fields(self)}
        fields = {k: v for k, v in changes.items() if k in names}
        extra = {k: v for k, v in changes.items() if k not in names}
        if extra:
            fields["workload_args"] = {**self.workload_args, **extra}
        return dataclasses.replace(self, **fields)


def default(name: str) -> Any:
    """A field's default, for the flag that sets it."""
    return next(f.default for f in dataclasses.fields(LoadSpec) if f.name == name)


@functools.cache
def workload_defaults() -> dict[str, Any]:
    """Every registered workload's own settings, at their flags' defaults."""
    from pdserve.workloads import streams as workloads

    parser = argparse.ArgumentParser(add_help=False)
    workloads.add_arguments(parser)
    return dict(vars(parser.parse_args([])))
