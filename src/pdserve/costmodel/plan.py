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

from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.costmodel.capacity import (
    SLO,
    ColocatedCapacity,
    DecodeCapacity,
    PrefillCapacity,
    Shape,
    colocated_capacity,
    decode_capacity,
    decode_tpot,
    kv_batch_limit,
    prefill_capacity,
)
from pdserve.costmodel.model import CostModel

BLOCK = 16  # the prefix cache reuses whole blocks of the engine's default size
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
