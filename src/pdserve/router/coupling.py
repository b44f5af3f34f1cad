"""P and D on one host's cores (`--adaptive`): what prefilling a prompt on one side does to the
prompts the other side has queued, and which prompts D keeps. Pure functions over the
router's `WorkerLoad`s, for the SLO planner (slo.py); `threads.price` sets, each sample, how many
times slower each side's queue runs while the other prefills (`SloPlanner.coupled`,
`SloPlanner.coupled_decode`).

Two processes on shared cores split them: a prompt on P while D prefills one itself (or the
reverse) leaves each on its `split` share, so of two prompts the first ends later than it
would have on every core and the second no sooner (the seeds' case, 2 cores: three 2000-token
prompts at once, one sent to D, took 8.6 / 14.8 / 6.8 s against the colocated worker's 3.1 /
6.1 / 9.4). Each route is charged what it does to the other side's queue (`queued_stretch`), and
while D decodes with P idle a prompt D can take within the SLOs stays there (`rides_decode`):
its chunks ride D's decode steps on every core, as the colocated worker's do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from pdserve.router.loads import WorkerLoad

if TYPE_CHECKING:
    from pdserve.router.slo import Route


def queued_stretch(
    queues: Iterable[tuple[WorkerLoad, float]],
    busy_s: float,
    now: float,
    k: float,
    slo_ttft_s: float | None,
) -> tuple[float, int]:
    """(delay added, prompts pushed past the TTFT SLO) over the prompts queued on each worker
    of `queues`, which runs f times slower while the other side prefills for `busy_s` seconds:
    a prompt with `left` seconds to go loses the lesser of left (f - 1) (it ends within that
    prefill) and busy_s (1 - 1/f). `k`: the planner's TTFT calibration."""
    added, late = 0.0, 0
    for w, f in queues:
        for j, left in w.prefill_ends(now):
            extra = min(left * (f - 1), busy_s * (1 - 1 / f)) * k
            added, ttft = added + extra, now - j.queued_at + left * k
            late += slo_ttft_s is not None and ttft <= slo_ttft_s < ttft + extra
    return added, late


def rides_decode(route: Route, loads: dict[str, WorkerLoad], now: float) -> bool:
    """A local route to a D with work (decoding, or prompts of its own queued) while no other
    worker owes a prefill: prefilled there, the prompt keeps every core on one side."""
    if route.kind != "local" or not loads[route.first].jobs:
        return False
    d = loads[route.first]
    return all(w.prefill_backlog(now) <= 0 for w in loads.values() if w is not d)
