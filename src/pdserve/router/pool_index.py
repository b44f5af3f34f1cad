"""`PoolIndex`: which prompt prefixes each KV pool probably holds (pure: no sockets).

A worker with a KV pool puts every full block it registers into it (engine/pool_link.py), so
the block hashes its `KVEvents` report as stored are, give or take a dropped write, in its pools.
Workers name their pools in `WorkerInfo.kv_pools` (workers/pool.py `pool_ids`: a memory tier
is the worker's own, a disk folder is shared by a host's workers, a Redis server by everyone
naming it). The index keeps, per pool, the last `max_hashes` hashes stored by any of its
workers, and answers "how many leading prompt tokens could this worker load from a pool".

Removals are not applied: a worker evicting a block from its own cache leaves it in the pool.
The pool's own evictions are not seen, so the index may overstate; it is a routing hint, like
the prefix index: a worker always asks the pool itself, and a miss costs a recompute.
"""

from __future__ import annotations

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

    def stats(self) -> dict[str, Any]:
        return {pid: len(held) for pid, held in self._pools.items()}
