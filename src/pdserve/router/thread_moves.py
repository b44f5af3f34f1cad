"""The router's side of moving cores between P and D (`pdserve serve --adaptive`): every
`interval_s` it samples the pools, asks the pure `ThreadPolicy` (threads.py) for each worker's
target and sends `SetThreads` in hand-over order (`threads.handover`). A worker applies it
between engine steps and answers with its stats, whose `threads` the next sample reads as the
acknowledgement (and the planner's predictions for that worker scale to it,
`WorkerLoad.slowness`). The router also samples at once when it dispatches a prompt and when a
worker acknowledges a new count (`poke`). Each change of the split is counted
(`thread_moves_to_{prefill,decode}`, `pdserve_thread_moves_total`); each worker's count is
`pdserve_worker_threads`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from pdserve.router import slo, threads
from pdserve.router.events import RouterEvents
from pdserve.router.links import Links
from pdserve.router.threads import ThreadPolicy, ThreadSample, handover
from pdserve.workers import messages as m

RESEND_S = 2.0  # a SetThreads not acknowledged by then is sent again (a dropped message)


class ThreadMover:
    def __init__(
        self,
        links: Links,
        events: RouterEvents,
        planner: slo.SloPlanner,
        policy: ThreadPolicy,
        interval_s: float = 0.25,
    ) -> None:
        self.links, self.events, self.planner, self.policy = links, events, planner, policy
        self.interval_s = interval_s
        self.targets: dict[str, int] = {}
        # worker -> (threads, step_tokens, when) last sent
        self._sent: dict[str, tuple[int, int, float]] = {}
        self.decode_slack_s = 0.0  # the last sample's (why D holds or not, on /admin/pools)

    def sample(self, now: float) -> ThreadSample:
        pools = self.links.pools()
        p = {w.worker_id: w.load for w in pools["prefill"]}
        d = {w.worker_id: w.load for w in pools["decode"]}
        resume = self.policy.resume_slowness(len(p), len(d))
        return threads.sample(p, d, self.planner, now, resume)

    def tick(self, now: float) -> None:
        s = self.sample(now)
        if not s.prefill or not s.decode:
            return  # a pool is empty (a worker down or switching): leave the counts alone
        targets = self.policy.observe(now, s)
        self.decode_slack_s = s.decode_slack_s
        current = {w.worker_id: w.stats.threads or 0 for w in self.links.workers}  # 0: held
        for ws in self.links.workers:  # the planner predicts each at the threads it runs now
            if ws.worker_id in targets:  # a request's TPOT is learned less D's holds
                ws.load.set_held(targets[ws.worker_id] == 0, now)
            if ws.stats.threads:
                ws.load.slowness = threads.slowness(ws.stats.threads, self.policy.profiled_threads)
        # ... and its prefills at those it will run them on
        threads.price(
            self.policy, s, {w.worker_id: w.load for w in self.links.workers}, self.planner
        )
        self._count(self.targets or _reported(self.links.workers), targets, s)
        self.targets = targets
        steps = self.policy.step_tokens(targets)
        moves = handover(current, targets)
        for w, n in targets.items():  # a step cap not sent yet (at start-up) goes on its own
            if (
                w not in moves
                and current.get(w) == n
                and self._sent.get(w, ())[:2] != (n, steps[w])
            ):
                moves[w] = n
        for worker_id, n in moves.items():
            sent = self._sent.get(worker_id)
            if sent is not None and sent[:2] == (n, steps[worker_id]) and now - sent[2] < RESEND_S:
                continue
            found = self.links.find(worker_id)
            if found is not None:
                self.links.send(found, m.SetThreads(n, steps[worker_id]))
                self._sent[worker_id] = (n, steps[worker_id], now)

    def _count(
        self, before_: Mapping[str, int | None], targets: dict[str, int], s: ThreadSample
    ) -> None:
        """`before_`: the last targets (or, at the first sample, what the workers run; a held
        worker's 0 counts, a worker that has not reported is None)."""
        if any(before_.get(w) is None for w in targets):
            return  # a worker not reported yet, or the pools changed: not a move between them
        # P's share of the threads: a parked P keeps its one thread while D's count changes
        before, after = _prefill_share(before_, s), _prefill_share(targets, s)
        if after != before:
            self.events.thread_move("prefill" if after > before else "decode")

    def status(self) -> dict[str, Any]:
        """The split for GET /admin/pools: the policy's state, targets, what workers run."""
        return {
            "cores": self.policy.cores,
            "state": self.policy.state,
            "prefill_cores": self.policy.p_cores,
            # inf (nothing decoding) is not JSON: None
            "decode_slack_s": round(self.decode_slack_s, 3) if self.decode_slack_s < 1e9 else None,
            "targets": dict(self.targets),
            "workers": {w.worker_id: w.stats.threads for w in self.links.workers},
            "moves": {k: v for k, v in self.events.counters.items() if "thread_moves" in k},
        }

    def poke(self) -> None:
        """Sample now, not at the next tick: a prompt just booked on P (its `SetThreads` then
        precedes the prompt on P's socket, so the prompt's first chunk runs on the new count),
        or a worker that acknowledged a count (the grow waiting on that shrink goes at once)."""
        self.tick(time.monotonic())

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.tick(time.monotonic())


def _unsent(sent: Mapping[str, tuple[int, int, float]], w: str, n: int, step: int) -> bool:
    return sent.get(w, (None, None))[:2] != (n, step)


def _reported(workers: Any) -> dict[str, int | None]:
    return {w.worker_id: w.stats.threads for w in workers}


def _prefill_share(threads: Mapping[str, int | None], s: ThreadSample) -> float:
    p = sum(threads[w] or 0 for w in s.prefill)
    return p / max(1, p + sum(threads[w] or 0 for w in s.decode))
