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
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.costmodel.model import CostModel
from pdserve.engine.step_log import StepRecord
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


def run_level(model: CostModel, logs: Mapping[str, Sequence[StepRecord]]) -> dict[str, Any]:
    """The measured / priced ratios of the run's lone steps (module docstring)."""
    step = CostModelStep(model)
    lone = lone_steps(logs)
    kinds: dict[str, list[float]] = {"prefill": [], "decode": []}
    for s in lone:
        if bool(s.decodes) == bool(s.chunks):
            continue  # a mixed step (or an empty one)
        kind = "decode" if s.decodes else "prefill"
        kinds[kind].append(s.seconds / step.priced(s.decodes, s.context, s.chunks))
    out: dict[str, Any] = {"from": "steps", "steps": sum(len(v) for v in logs.values())}
    out["lone_steps"] = len(lone)
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
