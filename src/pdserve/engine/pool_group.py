"""One KV group's side of the KV pool (engine/pool_link.py): its manager, its layers of the paged
cache and the pool under its namespace; what it puts as blocks register, and how loaded KV is
checked and written.

A model with one KV group has one `GroupLink` over every layer, under the pool's own namespace.
A model mixing sliding and global layers (engine/hybrid_kv.py) has one per group, each under a
namespace naming that group's layers (`PoolNamespace.for_layers`): a value holds exactly the
layers of the group that put it, so it is never read by the other group nor by an engine
keeping every layer in one group. The global group chunks as the pool's namespace says; the
sliding group stores one block per value (`SLIDING_CHUNK_BLOCKS`), put right after the step
that filled it, before the window frees it (a chunk of several blocks could outlive the
window that held its first blocks).

Put: the pool stores chunks of C = `namespace.chunk_blocks` blocks aligned on multiples of C
(kvpool/api.py), so blocks the manager registered during a step join their request's *open
chunk* (block ids and hashes only, no copy). When a registered block ends a chunk (index % C ==
C-1), the chunk - with any leading blocks of it the request found cached rather than computed -
is copied out, one tensor [group layers, 2, block_size, kv_heads, head_dim] per block, and
handed to `pool.put`, which never blocks (a full write-back queue drops and counts). The open
rest is put as a partial chunk when the request ends or is preempted, from the blocks that still
hold their hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.kvpool.api import BlockHash, KVPool

SLIDING_CHUNK_BLOCKS = 1

# (index in its chain, block id, hash) of an open chunk's blocks
_Open = list[tuple[int, int, BlockHash]]


@dataclass
class PutStats:
    put_blocks: int = 0
    put_drops: int = 0  # blocks of chunks the write-back queue dropped
    # blocks not put: a chunk's leading blocks were no longer registered, or (sliding window)
    # no longer held their KV when the chunk filled
    put_gaps: int = 0


@dataclass
class GroupLink:
    pool: KVPool
    cache: PagedKVCache
    kv: KVCacheManager
    group: int  # the cache's KV group (PagedKVCache.layer_group)
    stats: PutStats  # the link's (PoolLinkStats): both groups count together
    _open: dict[str, _Open] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layers = [i for i, g in enumerate(self.cache.layer_group) if g == self.group]
        self.kv.track_registered = True

    # ---- load --------------------------------------------------------------------------------
    def block_shape(self) -> tuple[int, ...]:
        layout = self.cache.layout
        return (len(self.layers), 2, self.cache.block_size, layout.num_kv_heads, layout.head_dim)

    def valid_run(self, kvs: list[torch.Tensor]) -> tuple[int, Exception | None]:
        """How many leading tensors have the shape of one of this group's blocks (a mismatch
        is a corrupt entry as far as this engine is concerned: recomputed), and the error."""
        shape = self.block_shape()
        for i, kv in enumerate(kvs):
            if tuple(kv.shape) != shape:
                return i, ValueError(f"pool block of shape {tuple(kv.shape)}, need {shape}")
        return len(kvs), None

    def write(self, block_ids: list[int], kvs: list[torch.Tensor]) -> None:
        for block_id, kv in zip(block_ids, kvs, strict=False):
            for i, layer in enumerate(self.layers):
                k_cache, v_cache = self.cache.layers[layer]
                k_cache[block_id].copy_(kv[i, 0])
                v_cache[block_id].copy_(kv[i, 1])

    def read_block(self, block_id: int) -> torch.Tensor:
        kvs = [self.cache.layers[layer] for layer in self.layers]
        return torch.stack([torch.stack((k[block_id], v[block_id])) for k, v in kvs]).contiguous()

    # ---- put ---------------------------------------------------------------------------------
    def after_step(self, skip: set[str]) -> list[Exception]:
        """The blocks registered during the step join their open chunks; full chunks are put.
        `skip`: requests preempted in the step, whose open chunks are put as they are.
        Returns what the pool raised (the link counts it; a put that fails is a block not
        stored, never a failed step)."""
        errors: list[Exception] = []
        for rid in skip:
            errors += self.put_open(rid)
        for rid, index, block_id, block_hash in self.kv.take_registered():
            if rid in skip or not self.kv.block_holds(block_id, block_hash):
                continue
            errors += self._add(rid, index, block_id, block_hash)
        return errors

    def _add(self, rid: str, index: int, block_id: int, block_hash: BlockHash) -> list[Exception]:
        c = self.pool.namespace.chunk_blocks
        start = index - index % c
        blocks = self._open.pop(rid, [])
        if not blocks or blocks[0][0] != start or blocks[-1][0] != index - 1:
            # The chunk's blocks before this one were found cached (or came before a
            # preemption): the request holds them now.
            held = self.kv.registered_blocks(rid, start, index)
            blocks = [(start + i, bid, h) for i, (bid, h) in enumerate(held)]
            if len(blocks) != index - start:  # a block before it left the window, or (not
                self.stats.put_gaps += 1  # expected) is not registered: counted
                return []
        blocks.append((index, block_id, block_hash))
        if len(blocks) < c:
            self._open[rid] = blocks
            return []
        # Under a sliding window the chunk's first blocks may have left the window and been
        # taken again meanwhile: only what still holds its KV goes in (from the chunk's start).
        valid = self._holding(blocks)
        self.stats.put_gaps += c - valid
        return self._put(blocks[:valid])

    def put_open(self, rid: str) -> list[Exception]:
        """Put the request's open chunk as a partial one: its leading blocks that still hold
        their KV (a preempted request's blocks are free, and may be reused by now)."""
        blocks = self._open.pop(rid, [])
        return self._put(blocks[: self._holding(blocks)])

    def _holding(self, blocks: _Open) -> int:
        """How many leading blocks still hold the KV they were registered with."""
        valid = 0
        while valid < len(blocks) and self.kv.block_holds(blocks[valid][1], blocks[valid][2]):
            valid += 1
        return valid

    def _put(self, blocks: _Open) -> list[Exception]:
        if not blocks:
            return []
        try:
            ok = self.pool.put(
                blocks[0][0], [h for _, _, h in blocks], [self.read_block(b) for _, b, _ in blocks]
            )
        except Exception as e:
            return [e]
        self.stats.put_blocks += len(blocks) if ok else 0
        self.stats.put_drops += 0 if ok else len(blocks)
        return []
