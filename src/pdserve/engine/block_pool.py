"""KV memory, layers one and two: `Block` and `BlockPool`.

The pool owns every block. A block is either referenced (ref_cnt > 0, used by running requests)
or sits in the free queue. A free block may still hold valid KV for a cached prefix (it has a
`block_hash`); it stays reusable by hash until it is evicted, which happens when it reaches the
front of the free queue (least recently freed first, i.e. LRU).

Block hashes chain: hash(block i) = sha256(hash(block i-1) || tokens of block i), so equal hashes
mean equal whole prefixes. sha256 (not Python's salted `hash()`) keeps them identical across
processes, which prefill and decode workers rely on to agree on what is cached.

Prefix-cache events: every hash that enters the hash map (`cache_block`) or leaves it (eviction
on reuse, `reset_prefix_cache`) is recorded, so a worker can tell routers what it holds
(`take_events`). Only the net change since the last drain is kept (the latest of stored/removed
per hash), and the buffer is bounded: past `max_pending_events` it is dropped and the next drain
reports the whole current set with `cleared=True` instead.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

BlockHash = bytes

# The parent of the first block; a deployment may mix in a model fingerprint instead.
ROOT_HASH: BlockHash = b"pdserve-prefix-v1"


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chained content hash of one full block."""
    payload = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.sha256(parent + payload).digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, root: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, in order (equal to chaining
    `hash_block_tokens`, but the tokens are converted to bytes once, not per block)."""
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    payload = np.asarray(token_ids[: num_full * block_size], dtype="<i8").tobytes()
    step = block_size * 8
    hashes: list[BlockHash] = []
    parent = root
    sha256 = hashlib.sha256
    for start in range(0, num_full * step, step):
        parent = sha256(parent + payload[start : start + step]).digest()
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


# Pending prefix-cache events kept between drains before falling back to a full snapshot.
MAX_PENDING_EVENTS = 100_000


class BlockPool:
    """Free queue (LRU order), reference counts and the hash -> block map of the prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        max_pending_events: int = MAX_PENDING_EVENTS,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> Block; front = evicted first.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self.num_evictions = 0
        # hash -> True (stored) / False (removed): the net change since the last take_events
        self._events: dict[BlockHash, bool] = {}
        self._events_overflowed = False
        self.max_pending_events = max_pending_events

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[Block]:
        """Take `n` blocks from the front of the free queue, evicting cached content."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; pass blocks in the order they should be evicted."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: Block, block_hash: BlockHash) -> bool:
        """Register a full block's content; the first block with a given hash wins. True when
        this call registered it."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self._record(block_hash, True)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash of free blocks; returns how many were dropped."""
        dropped = 0
        for block in self._free.values():
            if block.block_hash is not None:
                self._evict(block)
                dropped += 1
        return dropped

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self.num_evictions += 1
            self._record(block.block_hash, False)
        block.block_hash = None

    # ---- prefix-cache events ------------------------------------------------------------------
    def _record(self, block_hash: BlockHash, stored: bool) -> None:
        if self._events_overflowed:
            return  # the next drain sends the whole set anyway
        # Latest wins: stored-then-removed reports a removal (harmless if the consumer never saw
        # it), removed-then-stored a store; either way the consumer ends in the pool's state.
        self._events[block_hash] = stored
        if len(self._events) > self.max_pending_events:
            self._events.clear()
            self._events_overflowed = True

    @property
    def has_events(self) -> bool:
        """Whether `take_events` has anything to report (a cheap per-loop check)."""
        return bool(self._events) or self._events_overflowed

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        """Drain the changes since the last call: (stored, removed, cleared).

        `cleared=True` means the pending buffer overflowed: `stored` is then every hash in the
        map and the consumer must replace what it knew (removed is empty).
        """
        if self._events_overflowed:
            self._events_overflowed = False
            self._events.clear()
            return self.cached_hashes(), [], True
        stored = [h for h, s in self._events.items() if s]
        removed = [h for h, s in self._events.items() if not s]
        self._events.clear()
        return stored, removed, False

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the map now (a snapshot for a new subscriber)."""
        return list(self._cached)
