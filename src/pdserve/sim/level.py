"""How fast this host ran during a real run, against the cost model: the run's own level.

The validation (sim/validate.py) simulates a real run with a cost model profiled minutes before
it. On a shared VM the level of every step drifts 5-25% in those minutes (docs/benchmarks/sim.md,
"2026-12-02 on Zen 4"), more than the validation's targets; that error belongs to the profile's
timing, not to the simulator's queueing, batching, routing and contention. To tell them apart,
the workers' own step logs (engine/step_log.py) are priced with the cost model
(`CostModelStep.priced`, the simulator's own pricing) and compared step by step:

    prefill_x = median over prefill-only steps of measured / priced
    decode_x  = median over decode-only steps of measured / priced

Only steps no other worker's step overlapped count ("lone"): an overlapped step is slower by the
contention the simulator adds on its own, and counting it here would add it twice. Mixed steps
(a colocated worker's decodes with a prompt chunk) count in neither. With fewer than
`MIN_STEPS` lone steps of a kind, its factor is 1.0 and `fallback` says so.

Under load few steps are lone (a 1P1D P's prompts run beside D's decodes), so `run_level(...,
contention)` counts every step with the simulator's own contention divided out instead: a step
that ran `seconds` and overlapped another worker's step of kind k for `t` of them did the work
of `seconds - t (1 - 1 / slowdown(own kind, [k]))` alone (sim/host.py runs work at rate
1 / slowdown while others are mid-step; with more than two workers the overlaps are summed, at
most the step's length). Mixed steps then give prefill factors too: (work - decode_x x the
price of their decodes alone) / the price their chunks add, where the chunks are at least half
the step's price (a busy colocated worker's prompts run only in such steps).

A step that recorded its threads (`StepRecord.threads`), where the cost model was profiled at
`threads` others, is priced as the simulator runs it: x speedup(threads) / speedup(its own)
(`costmodel.capacity.speedup`, sim/cluster.py's thread moves), so `--adaptive`'s moving split
reads as the host's level, not as faster or slower steps.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.costmodel.capacity import speedup
from pdserve.costmodel.contention import Contention
from pdserve.costmodel.model import CostModel
from pdserve.engine.step_log import StepRecord
from pdserve.sim.host import step_kind
from pdserve.sim.steptime import CostModelStep

MIN_STEPS = 5


def lone_steps(logs: Mapping[str, Sequence[StepRecord]]) -> list[StepRecord]:
    """The steps that no other worker's step overlapped in time."""
    # A worker's own steps run one after another, so among its steps that begin before a step
    # ends, the last one ends last: it overlaps the step iff any of them does.
    ordered = {w: sorted(steps, key=lambda s: s.start) for w, steps in logs.items()}
    starts = {w: [s.start for s in steps] for w, steps in ordered.items()}
    out = []
    for w, steps in ordered.items():
        for s in steps:
            if not any(_overlapped_by(s, ordered[v], starts[v]) for v in ordered if v != w):
                out.append(s)
    return out


def _overlapped_by(s: StepRecord, other: list[StepRecord], starts: list[float]) -> bool:
    i = bisect.bisect_left(starts, s.start + s.seconds) - 1
    return i >= 0 and other[i].overlaps(s)


def alone_s(logs: Mapping[str, Sequence[StepRecord]], contention: Contention
            ) -> list[tuple[StepRecord, float]]:  # fmt: skip
    """Every step with the seconds it would have taken alone (module docstring)."""
    ordered = {w: sorted(steps, key=lambda s: s.start) for w, steps in logs.items()}
    starts = {w: [s.start for s in steps] for w, steps in ordered.items()}
    kinds = ("prefill", "decode")
    most = 1 - 1 / max(contention.slowdown(k, [o]) for k in kinds for o in kinds)
    out = []
    for w, steps in ordered.items():
        for s in steps:
            end, lost = s.start + s.seconds, 0.0
            for v in ordered:
                if v == w:
                    continue
                i = bisect.bisect_left(starts[v], end) - 1  # the last of v's begun before `end`
                while i >= 0 and ordered[v][i].start + ordered[v][i].seconds > s.start:
                    o = ordered[v][i]
                    t = min(end, o.start + o.seconds) - max(s.start, o.start)
                    # the record's chunks are the rows sim/host.py calls a step's prefill by
                    kind, other = step_kind(s.chunks), step_kind(o.chunks)
                    lost += t * (1 - 1 / contention.slowdown(kind, [other]))
                    i -= 1
            out.append((s, s.seconds - min(lost, s.seconds * most)))
    return out


def run_level(
    model: CostModel,
    logs: Mapping[str, Sequence[StepRecord]],
    contention: Contention | None = None,
    threads: int = 0,
) -> dict[str, Any]:
    """The measured / priced ratios of the run's lone steps, or with `contention` of every
    step with that contention divided out; `threads`: the model's profiled threads, against
    which steps that recorded theirs are priced (module docstring)."""
    step = _ThreadedStep(model, threads)
    lone = lone_steps(logs)
    timed = [(s, s.seconds) for s in lone] if contention is None else alone_s(logs, contention)
    kinds: dict[str, list[float]] = {"prefill": [], "decode": []}
    mixed = []
    for s, seconds in timed:
        if s.decodes and s.chunks:
            mixed.append((s, seconds))
        elif s.decodes or s.chunks:
            kind = "decode" if s.decodes else "prefill"
            kinds[kind].append(seconds / step.of(s))
    out: dict[str, Any] = {"from": "steps", "steps": sum(len(v) for v in logs.values())}
    out["lone_steps"] = len(lone)
    if contention is not None:
        out["contention"] = contention.measured
        out["mixed_steps"] = _prefill_from_mixed(step, mixed, kinds)
    fallback = []
    for kind, ratios in kinds.items():
        out[f"{kind}_steps"] = len(ratios)
        if len(ratios) < MIN_STEPS:
            out[f"{kind}_x"] = 1.0
            fallback.append(kind)
        else:
            out[f"{kind}_x"] = statistics.median(ratios)
    out["fallback"] = fallback  # kinds with too few lone steps: left at the profile's level
    return out


class _ThreadedStep:
    """`CostModelStep.priced` at the step's own threads (`StepRecord.threads`) against the
    model's (`threads`); either unknown (0): at the model's."""

    def __init__(self, model: CostModel, threads: int) -> None:
        self.step, self.threads = CostModelStep(model), threads

    def of(self, s: StepRecord, chunks: bool = True) -> float:
        price = self.step.priced(s.decodes, s.context, s.chunks if chunks else ())
        if self.threads and s.threads and s.threads != self.threads:
            price *= speedup(self.threads) / speedup(s.threads)
        return price


def _prefill_from_mixed(step: _ThreadedStep, mixed: Sequence[tuple[StepRecord, float]],
                        kinds: dict[str, list[float]]) -> int:  # fmt: skip
    """Add the prefill factors of mixed steps whose chunks are at least half their price, at
    the decode-only steps' factor; returns how many were added (none without enough decodes)."""
    if len(kinds["decode"]) < MIN_STEPS:
        return 0
    decode_x = statistics.median(kinds["decode"])
    n = 0
    for s, seconds in mixed:
        whole, decodes = step.of(s), step.of(s, chunks=False)
        if whole - decodes >= whole / 2:
            kinds["prefill"].append((seconds - decode_x * decodes) / (whole - decodes))
            n += 1
    return n
