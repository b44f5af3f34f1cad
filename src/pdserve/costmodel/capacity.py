"""The capacity of one worker for a request shape and its SLOs: a P worker at the TTFT SLO
(M/D/1 queueing), a D worker at the TPOT SLO (the largest batch, Little's law), a colocated
worker at both (bisection on its rate), and a worker's cost model at another thread count.
Arithmetic on a `CostModel`; the formulas and their assumptions are in plan.py's docstring
(`pdserve plan --help`), which builds its candidates from these.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pdserve.costmodel.model import CostModel

DEFAULT_EFFICIENCY = 0.8
MAX_BATCH = 1 << 16  # when a step's per-request cost is ~0, the batch is bounded only by this
_BISECT_STEPS = 100


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Shape:
    """One request of the workload: prompt length, tokens generated, prompt tokens cached."""

    input_len: int
    output_len: int
    cached_len: int = 0

    def __post_init__(self) -> None:
        if self.input_len < 1:
            raise ValueError(f"input_len must be >= 1, got {self.input_len}")
        if self.output_len < 2:
            raise ValueError(
                f"output_len must be >= 2 (TPOT is the time between output tokens), "
                f"got {self.output_len}"
            )
        if not 0 <= self.cached_len < self.input_len:
            raise ValueError(
                f"cached_len must be in [0, input_len): at least one prompt token is computed, "
                f"got {self.cached_len} of {self.input_len}"
            )

    @property
    def new_len(self) -> int:
        return self.input_len - self.cached_len

    @property
    def decode_steps(self) -> int:
        """Steps a request spends decoding: the first token comes from its prefill."""
        return self.output_len - 1

    @property
    def mean_context(self) -> float:
        return self.input_len + self.output_len / 2

    @property
    def final_context(self) -> int:
        return self.input_len + self.output_len


@dataclass(frozen=True)
class SLO:
    ttft_s: float  # mean time to first token
    tpot_s: float  # mean time per output token after the first

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be > 0 s, got TTFT {self.ttft_s}, TPOT {self.tpot_s}")


# --------------------------------------------------------------------------- threads


def speedup(threads: int, efficiency: float = DEFAULT_EFFICIENCY) -> float:
    """Compute speed of `threads` threads relative to one: 1 + efficiency * (threads - 1)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"parallel efficiency must be in (0, 1], got {efficiency}")
    return 1 + efficiency * (threads - 1)


def worker_model(
    base: CostModel,
    threads: int,
    *,
    base_threads: int = 1,
    efficiency: float = DEFAULT_EFFICIENCY,
    measured: Mapping[int, CostModel] | None = None,
) -> CostModel:
    """The cost model of a `threads`-thread worker: measured if given, else `base` (measured
    with `base_threads`) scaled by speedup(base_threads) / speedup(threads)."""
    if measured and threads in measured:
        return measured[threads]
    return base.scaled(speedup(base_threads, efficiency) / speedup(threads, efficiency))


# --------------------------------------------------------------------------- queueing


def md1_wait(utilization: float, service_s: float) -> float:
    """Mean wait in an M/D/1 queue."""
    if not 0 <= utilization < 1:
        return math.inf
    return utilization * service_s / (2 * (1 - utilization))


def max_md1_utilization(service_s: float, limit_s: float) -> float:
    """Largest rho with md1_wait(rho, S) + S <= limit (0 when S alone exceeds it)."""
    if service_s <= 0:
        return 1.0
    a = limit_s / service_s - 1
    return 0.0 if a <= 0 else 2 * a / (1 + 2 * a)


def _max_rate(ok: Callable[[float], bool], hi: float) -> float:
    """Largest rate in [0, hi) with ok(rate), for an `ok` that holds up to a point."""
    lo = 0.0
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


# --------------------------------------------------------------------------- capacities


@dataclass(frozen=True)
class PrefillCapacity:
    """One P worker at the TTFT SLO."""

    rate: float  # requests/s (0: the SLO is never met)
    service_s: float  # S, one prompt's prefill
    utilization: float  # busy fraction at that rate
    reason: str


def prefill_capacity(model: CostModel, shape: Shape, slo_ttft: float) -> PrefillCapacity:
    s = model.prefill_s(shape.new_len, shape.cached_len)
    rho = max_md1_utilization(s, slo_ttft)
    what = f"a {shape.new_len}-token prefill" + (
        f" (after {shape.cached_len} cached)" if shape.cached_len else ""
    )
    if rho <= 0:
        return PrefillCapacity(
            0.0, s, 0.0, f"{what} alone takes {s:.2f} s, over the {slo_ttft:g} s TTFT SLO"
        )
    reason = (
        f"{what} takes {s:.2f} s, and a P worker busy more than {rho:.0%} of the time queues "
        f"prompts past the {slo_ttft:g} s TTFT SLO: {rho / s:.3g} req/s per P worker"
    )
    return PrefillCapacity(rho / s, s, rho, reason)


@dataclass(frozen=True)
class DecodeCapacity:
    """One D worker at the TPOT SLO."""

    rate: float  # requests/s (0: the SLO is never met)
    batch: int  # requests decoding together at that rate
    step_s: float  # one decode step of that batch
    tpot_s: float  # mean TPOT, the transfer's delay of the second token included
    limit: str  # "tpot" | "kv"
    reason: str


def decode_tpot(model: CostModel, shape: Shape, batch: int, kv_bytes_per_token: int = 0) -> float:
    step = model.decode_step_s(batch, round(batch * shape.mean_context))
    handoff = model.transfer_s(shape.input_len * kv_bytes_per_token)
    return step + (handoff + model.receive_s(shape.input_len)) / shape.decode_steps


def _largest_batch(ok: Callable[[int], bool]) -> int:
    """Largest B in [1, MAX_BATCH] with ok(B), for a monotone ok; 0 if not even B = 1."""
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= MAX_BATCH and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_BATCH + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def kv_batch_limit(shape: Shape, max_kv_tokens: int | None) -> int:
    return MAX_BATCH if max_kv_tokens is None else max_kv_tokens // shape.final_context


def decode_capacity(
    model: CostModel,
    shape: Shape,
    slo_tpot: float,
    *,
    max_kv_tokens: int | None = None,
    kv_bytes_per_token: int = 0,
) -> DecodeCapacity:
    def tpot(b: int) -> float:
        return decode_tpot(model, shape, b, kv_bytes_per_token)

    by_slo = _largest_batch(lambda b: tpot(b) <= slo_tpot)
    by_kv = kv_batch_limit(shape, max_kv_tokens)
    if by_slo == 0:
        reason = f"even a batch of 1 decodes at {tpot(1) * 1e3:.0f} ms/token"
        return DecodeCapacity(0.0, 0, 0.0, tpot(1), "tpot", f"{reason}, over the TPOT SLO")
    if by_kv == 0:
        reason = f"one request's {shape.final_context} tokens of KV do not fit a worker's memory"
        return DecodeCapacity(0.0, 0, 0.0, tpot(1), "kv", reason)
    batch, limit = (by_kv, "kv") if by_kv < by_slo else (by_slo, "tpot")
    step = model.decode_step_s(batch, round(batch * shape.mean_context))
    rate = batch / (shape.decode_steps * step)
    bound = (
        "KV memory holds no more requests"
        if limit == "kv"
        else f"a larger batch passes the {slo_tpot * 1e3:g} ms TPOT SLO"
    )
    reason = (
        f"a D worker decodes a batch of {batch} at {step * 1e3:.0f} ms/step (TPOT "
        f"{tpot(batch) * 1e3:.0f} ms; {bound}): {rate:.3g} req/s per D worker"
    )
    return DecodeCapacity(rate, batch, step, tpot(batch), limit, reason)


@dataclass(frozen=True)
class ColocatedState:
    """A colocated worker's means at one arrival rate."""

    ttft_s: float
    tpot_s: float
    batch: float  # mean number of requests decoding
    prefill_busy: float  # fraction of time spent on prefills


def colocated_state(model: CostModel, shape: Shape, rate: float) -> ColocatedState | None:
    """Means at `rate` requests/s on one colocated worker (module doc); None if unstable."""
    s = model.prefill_s(shape.new_len, shape.cached_len)
    rho_p = rate * s
    d0 = model.decode_step_s(0, 0)
    g = model.decode_step_s(1, round(shape.mean_context)) - d0
    if rho_p >= 1:
        return None
    k = rate * shape.decode_steps / (1 - rho_p)
    if model.decode_by_batch:
        return _colocated_by_batch(model, shape, rate, s, rho_p, k)
    if k * g >= 1:
        return None
    n = k * d0 / (1 - k * g)
    tpot = (d0 + g * max(n, 1.0)) / (1 - rho_p)
    service = s + g * n
    rho = rate * service
    if rho >= 1:
        return None
    return ColocatedState(service + md1_wait(rho, service), tpot, n, rho_p)


def _colocated_by_batch(
    model: CostModel, shape: Shape, rate: float, s: float, rho_p: float, k: float
) -> ColocatedState | None:
    """`colocated_state` for a model with a decode term per batch size: the step is not
    d0 + g N, so N = k step(N) is solved numerically (the smallest root; None if there is none
    below MAX_BATCH), with step(N) = decode_step_s(N, N C), linear between profiled batch sizes
    (so a mean of 1.5 prices half the steps at one row and half at two). For a one-line model
    this is the closed form above."""

    def step(n: float) -> float:
        return model.decode_step_s(n, round(n * shape.mean_context))

    lo, hi = 0.0, 1.0
    while k * step(hi) > hi:  # N = k step(N) has no root below hi yet
        lo, hi = hi, hi * 2
        if hi > MAX_BATCH:
            return None
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if k * step(mid) > mid else (lo, mid)
    n = hi
    tpot = step(max(n, 1.0)) / (1 - rho_p)
    service = s + step(n) - step(0)
    rho = rate * service
    if rho >= 1:
        return None
    return ColocatedState(service + md1_wait(rho, service), tpot, n, rho_p)


@dataclass(frozen=True)
class ColocatedCapacity:
    """One colocated worker at both SLOs."""

    rate: float  # requests/s (0: the SLOs are never met)
    limit: str  # what binds first: "ttft" | "tpot" | "kv"
    state: ColocatedState  # the means at that rate (at rate 0 when it is 0)
    reason: str


def colocated_capacity(
    model: CostModel, shape: Shape, slo: SLO, *, max_kv_tokens: int | None = None
) -> ColocatedCapacity:
    s = model.prefill_s(shape.new_len, shape.cached_len)
    by_kv = kv_batch_limit(shape, max_kv_tokens)
    hi = 1 / max(s, 1e-9)  # prefills alone saturate the worker there

    def holds(check: Callable[[ColocatedState], bool]) -> Callable[[float], bool]:
        return lambda r: (st := colocated_state(model, shape, r)) is not None and check(st)

    rates = {
        "ttft": _max_rate(holds(lambda st: st.ttft_s <= slo.ttft_s), hi),
        "tpot": _max_rate(holds(lambda st: st.tpot_s <= slo.tpot_s), hi),
        "kv": _max_rate(holds(lambda st: st.batch <= by_kv), hi) if by_kv >= 1 else 0.0,
    }
    limit = min(rates, key=lambda k: rates[k])
    rate = rates[limit]
    state = colocated_state(model, shape, rate) or colocated_state(model, shape, 0.0)
    assert state is not None  # rate 0 is always stable
    return ColocatedCapacity(rate, limit, state, _colocated_reason(rate, limit, state, s, slo))


def _colocated_reason(rate: float, limit: str, st: ColocatedState, s: float, slo: SLO) -> str:
    if rate <= 0:
        if limit == "ttft":
            return f"a prefill alone takes {s:.2f} s, over the {slo.ttft_s:g} s TTFT SLO"
        if limit == "tpot":
            return f"even one request decodes at {st.tpot_s * 1e3:.0f} ms/token, over the SLO"
        return "one request's KV does not fit a worker's memory"
    what = {
        "ttft": f"its mean TTFT passes {slo.ttft_s:g} s",
        "tpot": f"its mean TPOT passes {slo.tpot_s * 1e3:g} ms",
        "kv": "its KV memory is full",
    }[limit]
    return (
        f"a colocated worker takes {rate:.3g} req/s before {what}: prefills of {s:.2f} s keep "
        f"it {st.prefill_busy:.0%} busy, stalling a mean batch of {st.batch:.1f} decodes to "
        f"{st.tpot_s * 1e3:.0f} ms/token, and the mean TTFT is {st.ttft_s:.2f} s"
    )
