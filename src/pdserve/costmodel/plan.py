"""`pdserve plan`: how to split a machine's cores into prefill (P) and decode (D) workers, or
colocated ones, for a workload and its SLOs, from the measured cost model (`pdserve bench
profile`). It enumerates every split, estimates each one's goodput (requests/s served within
both SLOs) and recommends the best, naming what limits it.

Everything here is arithmetic on a `CostModel` (no engine, no sockets); the SLOs are on the MEAN
TTFT and TPOT, so leave headroom for the tails. Assumptions, each a parameter or a formula below:

Threads. A worker with t threads uses the cost model measured with t threads when that file
exists (same name, `-t<t>.json`); otherwise the measured model's compute terms are divided by
speedup(t) = 1 + e * (t - 1): each added thread adds `e` (--parallel-efficiency, 0.8) of a
thread's work. The KV transfer is not scaled (memory copies and the link).

Prompt. S = prefill_s(input - cached, cached): `cached` prompt tokens come from the prefix cache
(--cached-len, default per workload: synthetic 0; rag 48, the 3 whole 16-token blocks of its
58-token shared system prompt and chat header; multiturn half the prompt, the earlier turns,
a rough middle for 2-3 turn conversations).

P pool, k workers. Requests are spread evenly, each worker is M/D/1 (Poisson arrivals,
deterministic service S): mean wait W = rho S / (2 (1 - rho)), rho = lambda_w S. The TTFT is
W + S (P emits the first token), so W + S <= slo_ttft  <=>  rho <= 2a / (1 + 2a) with
a = slo_ttft / S - 1, and the pool takes k rho / S requests/s. (KV encoding on P is ignored.)

D pool, k workers. A request decodes out - 1 tokens on D (P emitted the first). A batch of B
requests steps in step(B) = decode_step_s(B, B * (input + output / 2)), the mean context; the
mean TPOT is step(B) + (transfer_s(input * KV bytes per token) + receive_s(input)) / (out - 1),
as the hand-off delays the second token. B is the largest integer batch with TPOT <= slo_tpot
and, when KV memory is known, B * (input + output) <= KV tokens per worker. By Little's law a
D worker then completes B / ((out - 1) step(B)) requests/s.

Colocated, k workers each doing both, at lambda_w requests/s each. Per decoding request a step
costs g = decode_step_s(1, C) - d0 (C = input + output / 2) on top of the fixed d0. Prefills
take the fraction rho_p = lambda_w S of the worker's time, and each admitted prompt stalls every
running decode by S, so decode steps of duration d0 + g N happen only in the rest:
    TPOT = (d0 + g N) / (1 - rho_p)          (~ step + lambda_w S step for small rho_p)
with N, the mean decode batch, from Little's law: N = lambda_w (out - 1) TPOT, solved in closed
form as N = k d0 / (1 - k g), k = lambda_w (out - 1) / (1 - rho_p) (unstable when k g >= 1);
with a decode term per batch size (cost-model file v3) N = k step(N) is solved numerically. A
request's own TPOT uses max(N, 1) rows: it is in the batch. A prompt's step also runs the decode
rows (S + g N), and prompts queue as in M/D/1 on that service time, so
    TTFT = S' + rho' S' / (2 (1 - rho')),  S' = S + g N,  rho' = lambda_w S'.
Both grow with lambda_w, so the capacity is the largest lambda_w meeting both SLOs (and
N <= the KV batch limit), found by bisection; the one that binds first is the bottleneck.

Candidates: every homogeneous split kP x tP threads + kD x tD threads with kP tP + kD tD <=
cores, and every k colocated x t threads with k t <= cores, t from --threads-options. Goodput is
min(P pool, D pool) for a split, k x the per-worker capacity for colocated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pdserve.costmodel.model import CostModel

DEFAULT_EFFICIENCY = 0.8
MAX_BATCH = 1 << 16  # when a step's per-request cost is ~0, the batch is bounded only by this
BLOCK = 16  # the prefix cache reuses whole blocks of the engine's default size
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


WORKLOADS = ("synthetic", "rag", "multiturn")


def default_cached_len(workload: str, input_len: int) -> int:
    """Prompt tokens a prefix cache typically serves for this workload (see the module doc)."""
    if workload == "synthetic":
        return 0
    if workload == "rag":
        cached = 48
    elif workload == "multiturn":
        cached = input_len // 2 // BLOCK * BLOCK
    else:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    return max(0, min(cached, (input_len - 1) // BLOCK * BLOCK))


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


# --------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Candidate:
    kind: str  # "disaggregated" | "colocated"
    workers: int  # P workers, or colocated workers
    threads: int  # threads per P (or colocated) worker
    d_workers: int  # 0 when colocated
    d_threads: int
    goodput: float  # requests/s within both SLOs
    bottleneck: str  # "P pool (TTFT)" | "D pool (TPOT)" | "D pool (KV memory)" | "TTFT" | ...
    why: str
    p_rate: float | None = None  # pool capacities of a split
    d_rate: float | None = None

    @property
    def cores(self) -> int:
        return self.workers * self.threads + self.d_workers * self.d_threads

    @property
    def label(self) -> str:
        if self.kind == "colocated":
            return f"{self.workers} colocated x{self.threads}t"
        return f"{self.workers}P x{self.threads}t + {self.d_workers}D x{self.d_threads}t"


def split_candidate(
    kp: int, tp: int, kd: int, td: int, p: PrefillCapacity, d: DecodeCapacity
) -> Candidate:
    p_pool, d_pool = kp * p.rate, kd * d.rate
    if p_pool <= d_pool:
        bottleneck = "P pool (TTFT)"
        why = (
            f"The P pool limits it: with {tp} thread(s), {p.reason}; {kp} P worker(s) take "
            f"{p_pool:.3g} req/s while the D pool could take {d_pool:.3g}."
        )
    else:
        bottleneck = "D pool (KV memory)" if d.limit == "kv" else "D pool (TPOT)"
        why = (
            f"The D pool limits it: with {td} thread(s), {d.reason}; {kd} D worker(s) take "
            f"{d_pool:.3g} req/s while the P pool could take {p_pool:.3g}."
        )
    if p_pool <= 0 or d_pool <= 0:
        why = f"Never meets the SLOs: {p.reason if p_pool <= 0 else d.reason}."
    return Candidate(
        "disaggregated", kp, tp, kd, td, min(p_pool, d_pool), bottleneck, why, p_pool, d_pool
    )


def colocated_candidate(k: int, t: int, c: ColocatedCapacity) -> Candidate:
    bottleneck = {"ttft": "TTFT", "tpot": "TPOT", "kv": "KV memory"}[c.limit]
    why = (
        f"Its {bottleneck} limits it: with {t} thread(s), {c.reason}; {k} worker(s) take "
        f"{k * c.rate:.3g} req/s."
        if c.rate > 0
        else f"Never meets the SLOs: {c.reason}."
    )
    return Candidate("colocated", k, t, 0, 0, k * c.rate, bottleneck, why)


def enumerate_candidates(
    models: Mapping[int, CostModel],
    shape: Shape,
    slo: SLO,
    cores: int,
    *,
    max_kv_tokens: int | None = None,
    kv_bytes_per_token: int = 0,
    colocated: bool = True,
) -> list[Candidate]:
    """Every split of `cores` (threads per worker from the keys of `models`), best first."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    if not models:
        raise ValueError("need a cost model for at least one thread count")
    if min(models) > cores:
        raise ValueError(f"no thread option fits {cores} core(s): {sorted(models)}")
    pre = {t: prefill_capacity(m, shape, slo.ttft_s) for t, m in models.items()}
    dec = {
        t: decode_capacity(
            m, shape, slo.tpot_s, max_kv_tokens=max_kv_tokens, kv_bytes_per_token=kv_bytes_per_token
        )
        for t, m in models.items()
    }
    out = [
        split_candidate(kp, tp, kd, td, pre[tp], dec[td])
        for tp in models
        for td in models
        for kp in range(1, cores // tp + 1)
        for kd in range(1, (cores - kp * tp) // td + 1)
    ]
    if colocated:
        for t, m in models.items():
            cap = colocated_capacity(m, shape, slo, max_kv_tokens=max_kv_tokens)
            out += [colocated_candidate(k, t, cap) for k in range(1, cores // t + 1)]
    return sorted(out, key=lambda c: (-c.goodput, c.cores, c.kind, c.label))


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    shape: Shape
    slo: SLO
    cores: int
    candidates: tuple[Candidate, ...]  # best first
    recommended: Candidate | None  # None: no split meets the SLOs at any rate
    why: str


def make_plan(
    models: Mapping[int, CostModel],
    shape: Shape,
    slo: SLO,
    cores: int,
    *,
    max_kv_tokens: int | None = None,
    kv_bytes_per_token: int = 0,
    colocated: bool = True,
) -> Plan:
    cands = enumerate_candidates(
        models,
        shape,
        slo,
        cores,
        max_kv_tokens=max_kv_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        colocated=colocated,
    )
    best = cands[0] if cands[0].goodput > 0 else None
    runner_up = cands[1] if len(cands) > 1 else None  # feasible or not: its limit explains
    if best is None:
        why = _infeasible(models, shape, slo, kv_bytes_per_token, max_kv_tokens)
    else:
        why = _why(best, runner_up, shape, slo)
    return Plan(shape, slo, cores, tuple(cands), best, why)


def _why(best: Candidate, runner_up: Candidate | None, shape: Shape, slo: SLO) -> str:
    text = (
        f"Recommended: {best.label}, {best.goodput:.3g} req/s "
        f"({best.goodput * shape.output_len:.3g} output tokens/s) with mean TTFT <= "
        f"{slo.ttft_s:g} s and TPOT <= {slo.tpot_s * 1e3:g} ms. {best.why}"
    )
    if runner_up is not None and runner_up.goodput > 0:
        text += (
            f" Runner-up: {runner_up.label}, {runner_up.goodput:.3g} req/s "
            f"({runner_up.goodput / best.goodput:.0%} of it). {runner_up.why}"
        )
    elif runner_up is not None:
        text += f" Nothing else meets the SLOs; runner-up {runner_up.label}: {runner_up.why}"
    return text


def _infeasible(
    models: Mapping[int, CostModel],
    shape: Shape,
    slo: SLO,
    kv_bytes_per_token: int,
    max_kv_tokens: int | None,
) -> str:
    """Why nothing works: the best any thread count does for each SLO, at no load at all."""
    t = min(models, key=lambda k: models[k].prefill_s(shape.new_len, shape.cached_len))
    ttft = models[t].prefill_s(shape.new_len, shape.cached_len)
    tpot = min(decode_tpot(m, shape, 1, kv_bytes_per_token) for m in models.values())
    problems = []
    if ttft > slo.ttft_s:
        problems.append(
            f"the fastest worker ({t} thread(s)) prefills {shape.new_len} tokens in {ttft:.2f} s "
            f"alone, over the {slo.ttft_s:g} s TTFT SLO"
        )
    if tpot > slo.tpot_s:
        problems.append(
            f"a lone request decodes at {tpot * 1e3:.0f} ms/token at best, over the "
            f"{slo.tpot_s * 1e3:g} ms TPOT SLO"
        )
    if kv_batch_limit(shape, max_kv_tokens) < 1:
        problems.append(f"one request's {shape.final_context} tokens of KV do not fit a worker")
    detail = "; ".join(problems) or "every split is limited to zero by its queueing"
    return f"No split meets the SLOs at any request rate: {detail}."
