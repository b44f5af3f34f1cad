"""The KV pool in the simulator (`SimKVPool`): the shared store of KV blocks by chained hash
that kvpool/ is for real, as engine/pool_link.py uses it.

Put: every full block a worker registers (computed by a prompt chunk, received from P, filled
by decoding) joins the pool after the step that registered it (the real engine puts whole
chunks of blocks as they fill: a few blocks later, which this ignores). Load: before a worker
schedules, each waiting request it has not looked up yet, after its local prefix cache, takes
the run of its next full blocks the pool holds (`KVCacheManager.import_blocks`, as the real
`PoolLink.prefetch`), and the worker spends `load_s` of them on its next step: the bytes over
the pool's link plus a fixed cost per lookup. The scheduler then finds them as a prefix hit.

What is not modelled: the write-back queue (a put never drops), a tier's misses and corrupt
reads (a lookup's promise is always kept), and the pool's own server cores.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pdserve.kvpool.api import BlockHash


@dataclass
class SimKVPool:
    capacity_blocks: int | None  # None: unbounded
    bytes_s: float  # the pool's link, per worker
    per_lookup_s: float = 0.0  # a lookup's round trip
    _blocks: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)
    lookups: int = 0
    hit_blocks: int = 0
    put_blocks: int = 0
    evicted_blocks: int = 0

    def __post_init__(self) -> None:
        if self.capacity_blocks is not None and self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")
        if not self.bytes_s > 0:
            raise ValueError(f"bytes_s must be > 0, got {self.bytes_s}")

    def put(self, hashes: list[BlockHash]) -> None:
        for h in hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            self._blocks[h] = None
            self.put_blocks += 1
            if self.capacity_blocks is not None and len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)  # least recently put or read
                self.evicted_blocks += 1

    def lookup(self, hashes: list[BlockHash]) -> int:
        """How many of `hashes`, from the first, the pool holds (each touched)."""
        self.lookups += 1
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        self.hit_blocks += n
        return n

    def load_s(self, nbytes: float) -> float:
        return self.per_lookup_s + nbytes / self.bytes_s

    def stats(self, block_size: int) -> dict[str, Any]:
        return {
            "lookups": self.lookups,
            "hit_tokens": self.hit_blocks * block_size,
            "put_blocks": self.put_blocks,
            "evicted_blocks": self.evicted_blocks,
            "held_blocks": len(self._blocks),
            "capacity_blocks": self.capacity_blocks,
        }
