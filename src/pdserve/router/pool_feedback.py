"""What the router does with the workers' KV pools beyond routing (no sockets: the core calls it).

- **Reports**: a prefilling worker's first output carries what its pool did (`Tokens.pool`:
  lookup, hit, loaded and local tokens, load time). `on_report` puts `pool_lookup` /
  `pool_load` in the request's timeline, counts `pool_*` tokens, and after a recovery stamps
  `recovered_from_pool: loaded X on W, recomputed Y of Z tokens`.
- **Bandwidth**: each load feeds `PoolBandwidth` (bytes/s per worker, the SLO planner's when
  there is one), so the planner weighs a pool hit at the rate that worker really loads at.
- **Index corrections**: `expect` notes, at dispatch, how many leading tokens the pool index
  predicts the prefilling worker can load; a report finding fewer (the pool evicted them, or a
  write was dropped) makes the index forget that prompt's hashes from the first missing block
  on (`index_corrections`, counter `pool_index_corrections`).
- **Recovery on a D**: when a decode worker dies, `recovery_target` picks a surviving D whose
  pools the index says hold at least half of the request's context (prompt + streamed tokens);
  the request then runs there whole, its engine loading that context from the pool and
  computing only the tail: no P, no KV transfer. Otherwise the usual route (a P, which loads
  from its own pool and ships the KV to the new D).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pdserve.router import slo
from pdserve.router.events import RouterEvents
from pdserve.router.flight import Flight, WorkerState
from pdserve.router.pool_index import PoolBandwidth, PoolIndex
from pdserve.router.timeline import Ev, labelled

# A surviving D resumes a dead D's request from its own pool when the index says the pool holds
# at least this share of the context; below it, a P (its prefix cache + pool) does more of it.
MIN_POOLED_SHARE = 0.5
RECOVERY_ROUTE = "pool_resume"  # the route's name in the timeline and counters


class PoolFeedback:
    def __init__(
        self, index: PoolIndex, events: RouterEvents, planner: slo.SloPlanner | None
    ) -> None:
        self.index, self.events, self.planner = index, events, planner
        self.bandwidth = planner.pool_bandwidth if planner is not None else PoolBandwidth()
        self.corrections = 0

    # ---- at dispatch ---------------------------------------------------------------------
    def expect(self, flight: Flight, prompt: list[int]) -> None:
        """Note what the index predicts the attempt's prefilling worker loads from its pools
        (at most the full blocks before the last token: the engine always computes that)."""
        flight.pool_expected = None
        first = flight.pair[0] if flight.pair is not None else None
        if first is None or first.info is None or not first.info.kv_pools:
            return
        wid = first.worker_id
        predicted = self.index.match(prompt, {wid: first.info.kv_pools})[wid]
        bs = first.info.block_size
        predicted = min(predicted, (len(prompt) - 1) // bs * bs)
        if predicted > 0:
            flight.pool_expected = (wid, predicted, len(prompt))

    def recovery_target(
        self, flight: Flight, dead: WorkerState, workers: Iterable[WorkerState]
    ) -> WorkerState | None:
        """The surviving D to resume a dead D's request on from its pool, or None (the usual
        route): the D whose pools hold the most of the context, if that is enough."""
        if dead.role != "decode" or flight.params.n > 1:
            return None
        context = flight.prompt_ids + flight.sent
        candidates = {
            w.worker_id: w
            for w in workers
            if w is not dead
            and w.healthy
            and not w.draining
            and w.role == "decode"
            and w.info is not None
            and w.info.kv_pools
        }
        if not candidates:
            return None
        pools = {wid: w.info.kv_pools for wid, w in candidates.items() if w.info is not None}
        pooled = self.index.match(context, pools)
        wid = max(pooled, key=lambda k: (pooled[k], -candidates[k].outstanding))
        if pooled[wid] < MIN_POOLED_SHARE * len(context):
            self.events.count("recovery_pool_too_little")
            return None
        return candidates[wid]

    # ---- a worker's report ---------------------------------------------------------------
    def on_report(self, flight: Flight, worker: str, pool: dict[str, float], now: float) -> None:
        hit, loaded = int(pool.get("hit_tokens", 0)), int(pool.get("loaded_tokens", 0))
        local = int(pool.get("local_tokens", 0))
        load_s = float(pool.get("load_s", 0.0))
        at = float(pool.get("lookup_at", now))
        flight.timeline.append((labelled(Ev.POOL_LOOKUP, f"{hit} tokens"), worker, at))
        self.events.count("pool_lookups")
        self.events.count("pool_hit_tokens", hit)
        if hit:
            what = f"{loaded} of {hit} tokens"
            flight.timeline.append((labelled(Ev.POOL_LOAD, what), worker, at + load_s))
            self.events.count("pool_loaded_tokens", loaded)
            self.events.count("pool_short_tokens", hit - loaded)  # recomputed instead
        per_token = self.planner.kv_bytes_per_token if self.planner is not None else 0.0
        self.bandwidth.observe(worker, loaded, load_s, per_token)
        self._check_index(flight, worker, local + hit)
        if flight.recoveries and loaded and flight.pool_recovered != flight.attempt:
            # this attempt's prompt: the request's prompt + the tokens streamed before it
            context = len(flight.prompt_ids) + len(flight.sent)
            recomputed = max(0, context - local - loaded)
            flight.pool_recovered = flight.attempt
            what = f"loaded {loaded} on {worker}, recomputed {recomputed} of {context} tokens"
            flight.timeline.append((labelled(Ev.RECOVERED_FROM_POOL, what), worker, now))
            self.events.count("recovered_from_pool")
            self.events.count("recovery_pool_loaded_tokens", loaded)
            self.events.count("recovery_recomputed_tokens", recomputed)

    def _check_index(self, flight: Flight, worker: str, found: int) -> None:
        """The lookup found `found` leading tokens (local cache + pool run): if the index had
        predicted more for this worker, its pools no longer hold the rest."""
        expected = flight.pool_expected
        if expected is None or expected[0] != worker:
            return
        flight.pool_expected = None  # one report per attempt
        if found >= expected[1]:
            return
        first = flight.pair[0] if flight.pair is not None else None
        if first is None or first.worker_id != worker or first.info is None:
            return
        prompt = (flight.prompt_ids + flight.sent)[: expected[2]]
        if self.index.forget(first.info.kv_pools, prompt, found):
            self.corrections += 1
            self.events.count("pool_index_corrections")

    def stats(self) -> dict[str, Any]:
        return {"index_corrections": self.corrections, "bandwidth": self.bandwidth.stats()}


def kvpool_report(
    workers: Iterable[WorkerState],
    counters: dict[str, int],
    index: PoolIndex,
    feedback: PoolFeedback,
) -> dict[str, Any]:
    """GET /admin/kvpool: per worker with a KV pool, its pool ids, the engine's use of it
    (`kv_pool_*` of its last stats) and the tiers' stats; the pool index, its corrections and
    the measured pool bandwidth; the router's `pool` counters; and the prompt tokens every
    worker computed (with a pool or not): what the pool saves."""
    workers = list(workers)
    used = {}
    for w in workers:
        pools = w.info.kv_pools if w.info is not None else []
        if pools:
            use, tiers = w.stats.kv_pool_use(), w.stats.kv_pool_tiers()
            used[w.worker_id] = {"pools": pools, "use": use, "tiers": tiers}
    return {
        "workers": used,
        "index": index.stats(),
        **feedback.stats(),
        "router": {k: v for k, v in counters.items() if "pool" in k},
        "prefill_tokens": {w.worker_id: w.stats.prefill_tokens or 0 for w in workers},
    }
