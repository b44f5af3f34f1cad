"""How a decode worker's batch runs over a request's answer, for the planner's TPOT predictions
(`SloPlanner.predict`, `_running`): when the jobs there start decoding (`decode_starts`), how
many of a new request's steps each shares (`overlaps`), and the mean batch each running job
meets over its own remaining steps as the others finish (`drained`).
"""

from __future__ import annotations

from pdserve.router.loads import Job, WorkerLoad


def decode_starts(dec: WorkerLoad, loads: dict[str, WorkerLoad], now: float) -> dict[str, float]:
    """Per job on `dec` not decoding yet, seconds until it starts: when its prefill ends, on
    `dec` or on the P it was sent to (0 when none is owed anywhere: its KV is on the way)."""
    starts = {}
    for j in dec.decoding():
        if j.first_at is None or j.prefill_s > 0:
            ends = (w.prefilled_in(j.rid, now) for w in loads.values())
            starts[j.rid] = max((t for t in ends if t is not None), default=0.0)
    return starts


def overlaps(
    jobs: list[Job], starts: dict[str, float], start: float, out: int, step: float
) -> dict[str, float]:
    """Per job decoding on a worker, how many of a new request's `out` decode steps it shares
    with it: the job decodes from `starts` (0: now) for its tokens left, the new request from
    `start` seconds from now, both at `step` a token. (`_mean_step` counts the shared steps
    from the new request's first; a job starting later would share later ones.)

    Why: counting every job for the new request's whole answer made a remote route look as
    slow as a batch of 3 at 2k context (23.5 ms a token against a 20.9 ms SLO, on one thread),
    when P's ~7 s prefill meant those jobs had mostly finished before its KV arrived; one-thread
    1P1D refused 3 of 8 KB-QA requests at 0.06 req/s that unscheduled met it. And a job whose
    own prefill was queued on P ahead of the new one was counted for every step, though it
    would finish before the new one's KV came."""
    end = start + out * step
    overlap = {}
    for j in jobs:
        s_j = starts.get(j.rid, 0.0)
        shared = min(end, s_j + j.remaining * step) - max(start, s_j)
        overlap[j.rid] = min(float(out), max(0.0, shared / step))
    return overlap


def drained(jobs: list[Job]) -> dict[str, tuple[float, float]]:
    """Per job, the mean (streams, context tokens) of the batch over its remaining steps, the
    others leaving after theirs (all stepping from now, at one rate): a job with r_i steps left
    is in a job j's batch for min(r_i, r_j) of j's r_j. Sorted by steps left, with running
    sums: O(n log n).

    Why: priced at the batch of the moment for all their steps, requests just admitted looked
    within 1 ms of the TPOT SLO behind a batch of 14 whose 6 oldest had 1-34 steps left, and
    admission refused every new request as pushing them over (slo_tpot_running)."""
    order = sorted(jobs, key=lambda j: j.remaining)
    tail_s = sum(j.streams for j in order)
    tail_c = sum(j.context * j.streams for j in order)
    done_s = done_c = 0.0  # sum over the jobs already passed of streams (context) x steps
    out = {}
    for j in order:
        r = max(1, j.remaining)
        out[j.rid] = ((done_s + r * tail_s) / r, (done_c + r * tail_c) / r)
        done_s += j.streams * r
        done_c += j.context * j.streams * r
        tail_s -= j.streams
        tail_c -= j.context * j.streams
    return out
