"""`PoolIndex`: which prompt prefixes each KV pool probably holds (pure: no sockets).

A worker with a KV pool puts every full block it registers into it (engine/pool_link.py), so
the block hashes its `KVEvents` report as stored are, give or take a dropped write, in its pools.
Workers name their pools in `WorkerInfo.kv_pools` (workers/pool.py `pool_ids`: a memory tier
is the worker's own, a disk folder is shared by a host's workers, a Redis server by everyone
naming it). The index keeps, per pool, the last `max_hashes` hashes stored by any of its
workers, and answers "how many leading prompt tokens could this worker load from a pool".

Removals are not applied: a worker evicting a block from its own cache leaves it in the pool.
The pool's own evictions (Redis allkeys-lru, the disk and memory tiers' caps) and dropped
writes are learnt from misses instead: when a worker's lookup finds fewer leading tokens than
the index predicted for it, `forget` drops that prompt's hashes from the first block the pool
lacked onward (router/pool_feedback.py). The index is a routing hint, like the prefix index: a
worker always asks the pool itself, and a miss costs a recompute.

`PoolBandwidth` (pure too): per worker, how fast it loads KV from its pools (bytes/s), a moving
average of the loads its requests report, starting from a prior (the SLO planner's cost of a
pool hit).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.engine.block_pool import ROOT_HASH, BlockHash, hash_full_blocks

MAX_HASHES = 1_000_000  # per pool: ~50 MB of router memory at most


class PoolIndex:
    def __init__(self, max_hashes: int = MAX_HASHES, root_hash: BlockHash = ROOT_HASH) -> None:
        self.max_hashes, self.root_hash = max_hashes, root_hash
        self._pools: dict[str, OrderedDict[BlockHash, None]] = {}
        self._block_size: dict[str, int] = {}

    def add(self, pool_ids: Sequence[str], block_size: int, stored: Sequence[BlockHash]) -> None:
        for pid in pool_ids:
            held = self._pools.setdefault(pid, OrderedDict())
            self._block_size[pid] = block_size
            for h in stored:
                held[h] = None
                held.move_to_end(h)
            while len(held) > self.max_hashes:
                held.popitem(last=False)

    def match(
        self, prompt_ids: Sequence[int], workers: Mapping[str, Sequence[str]]
    ) -> dict[str, int]:
        """Per worker (its pool ids), the prompt's leading tokens found in one of its pools."""
        by_size: dict[int, list[BlockHash]] = {}
        per_pool: dict[str, int] = {}
        out: dict[str, int] = {}
        for wid, pids in workers.items():
            best = 0
            for pid in pids:
                if pid not in per_pool:
                    per_pool[pid] = self._match_pool(pid, prompt_ids, by_size)
                best = max(best, per_pool[pid])
            out[wid] = best
        return out

    def _match_pool(
        self, pid: str, prompt_ids: Sequence[int], by_size: dict[int, list[BlockHash]]
    ) -> int:
        held = self._pools.get(pid)
        if not held:
            return 0
        size = self._block_size[pid]
        hashes = by_size.get(size)
        if hashes is None:
            hashes = by_size[size] = hash_full_blocks(prompt_ids, size, self.root_hash)
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n * size

    def forget(self, pool_ids: Sequence[str], prompt_ids: Sequence[int], found: int) -> int:
        """A worker's pools hold only `found` leading tokens of the prompt: drop the prompt's
        hashes from the first block they lack onward (chained hashes: a later block cannot be
        loaded without it). Returns the hashes dropped."""
        dropped = 0
        for pid in pool_ids:
            held = self._pools.get(pid)
            if not held:
                continue
            size = self._block_size[pid]
            for h in hash_full_blocks(prompt_ids, size, self.root_hash)[found // size :]:
                if h in held:
                    del held[h]
                    dropped += 1
        return dropped

    def stats(self) -> dict[str, Any]:
        return {pid: len(held) for pid, held in self._pools.items()}


class PoolBandwidth:
    """Per worker, bytes/s of its pool loads: a moving average of log(rate) over the loads it
    reports, from `prior` (worth one load: the first report moves it half-way, later ones by
    `alpha`). In logs, so a prior off by orders of magnitude (1 GB/s vs a loaded disk) is
    corrected within a few loads in either direction. A load's time includes the lookup round
    trip and writing the blocks, so it is what a pool hit really costs the prefill; small loads
    (mostly that fixed cost) pull the estimate down."""

    def __init__(self, prior: float = 1e9, alpha: float = 0.2) -> None:
        if not prior > 0:
            raise ValueError(f"the pool bandwidth prior must be > 0 bytes/s, got {prior}")
        self.prior, self.alpha = prior, alpha
        self._log_rate: dict[str, float] = {}
        self._samples: dict[str, int] = {}

    def observe(self, worker: str, tokens: int, seconds: float, bytes_per_token: float) -> bool:
        """A load of `tokens` in `seconds`; ignored (False) while KV bytes per token are unknown
        or nothing was loaded."""
        if tokens <= 0 or seconds <= 0 or bytes_per_token <= 0:
            return False
        n = self._samples.get(worker, 0)
        a = max(self.alpha, 1 / (n + 2))
        sample = math.log(tokens * bytes_per_token / seconds)
        self._log_rate[worker] = (1 - a) * math.log(self.rate(worker)) + a * sample
        self._samples[worker] = n + 1
        return True

    def rate(self, worker: str) -> float:
        log_rate = self._log_rate.get(worker)
        return self.prior if log_rate is None else math.exp(log_rate)

    def stats(self) -> dict[str, Any]:
        workers = {
            w: {"bytes_per_s": round(self.rate(w)), "loads": n} for w, n in self._samples.items()
        }
        return {"prior_bytes_per_s": self.prior, "workers": workers}
