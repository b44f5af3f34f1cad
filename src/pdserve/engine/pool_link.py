"""The engine's side of the KV pool (issue 15): load a prompt's prefix from the pool before it is
scheduled, and put every full block the engine computes or receives into it.

Load (`prefetch`, before each `schedule()`): for a waiting request not yet looked up, after the
local prefix cache (`KVCacheManager.pool_candidates`), the pool is asked how many of the next
full-block hashes it holds (`lookup`), that run is loaded under a deadline (base + per token),
written into fresh engine blocks registered under those hashes (`import_blocks`), and held until
the scheduler has run once: it then finds them as an ordinary prefix hit and marks those tokens
computed. Whatever the lookup promised but `get` did not return (late, missing, corrupt) is
recomputed, and counted (`recomputed_tokens`). At most the last prompt token is always computed.

Put (`after_step`, right after the model ran): the pool stores chunks of C =
`namespace.chunk_blocks` blocks aligned on multiples of C (kvpool/api.py), so blocks the KV
manager registered during the step (prompt blocks P computed, a decode worker's received prompt
blocks on its first step, generated blocks as they fill) join their request's *open chunk*
(block ids and hashes only, no copy). When a registered block ends a chunk (index % C == C-1),
the chunk - with any leading blocks of it the request found cached rather than computed - is
copied out, one tensor [layers, 2, block_size, kv_heads, head_dim] per block, and handed to
`pool.put`, which never blocks (a full write-back queue drops and counts). The open rest is put
as a partial chunk when the request ends (`forget`: finished or aborted) or is preempted, from
the blocks that still hold their hashes. Trade-off: up to C-1 of a running request's newest
blocks are in no pool until then - a D killed mid-answer loses them, and the request's recovery
recomputes them (the kvpool-serve recovery benchmark reports loaded vs recomputed tokens).

Nothing here changes what the engine computes: a pool hit is KV that some worker with the same
namespace (model, dtype, layout, block size, codec, chunk size) computed for the same chained
hash.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.kvpool.api import BlockHash, KVPool

# Loading deadline: a fixed allowance plus a per-token one (1500 tokens: 0.25 + 0.15 s).
LOAD_BASE_S = 0.25
LOAD_PER_TOKEN_S = 1e-4


@dataclass
class PoolUse:
    """What the pool did for one request (reported with its first output)."""

    lookup_at: float
    hit_tokens: int  # promised by lookup (after the local prefix cache)
    loaded_tokens: int = 0  # arrived, verified, written into engine blocks
    local_tokens: int = 0  # found in the local prefix cache first
    load_s: float = 0.0

    def wire(self) -> dict[str, float]:
        return {
            "lookup_at": self.lookup_at,
            "hit_tokens": self.hit_tokens,
            "loaded_tokens": self.loaded_tokens,
            "local_tokens": self.local_tokens,
            "load_s": round(self.load_s, 6),
        }


@dataclass
class PoolLinkStats:
    lookups: int = 0
    hit_tokens: int = 0
    loaded_tokens: int = 0
    recomputed_tokens: int = 0  # promised by lookup, not delivered by get: computed instead
    load_seconds: float = 0.0
    put_blocks: int = 0
    put_drops: int = 0  # blocks of chunks the write-back queue dropped
    # blocks not put: a chunk's leading blocks were no longer registered, or (sliding window)
    # no longer held their KV when the chunk filled
    put_gaps: int = 0
    errors: int = 0  # a pool call raised: treated as a miss, counted
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items()}


@dataclass
class PoolLink:
    pool: KVPool
    cache: PagedKVCache
    kv: KVCacheManager
    base_s: float = LOAD_BASE_S
    per_token_s: float = LOAD_PER_TOKEN_S
    stats: PoolLinkStats = field(default_factory=PoolLinkStats)
    _probed: set[str] = field(default_factory=set)
    # request id -> (index, block id, hash) of its open chunk's blocks, from an aligned start
    _open: dict[str, list[tuple[int, int, BlockHash]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.kv.enable_prefix_caching:
            raise ValueError("the KV pool works through the prefix cache: enable prefix caching")
        if self.pool.namespace.block_size != self.kv.block_size:
            raise ValueError(
                f"the pool's namespace has block size {self.pool.namespace.block_size}, the "
                f"engine {self.kv.block_size}"
            )
        self.kv.track_registered = True

    # ---- load --------------------------------------------------------------------------------
    def prefetch(self, waiting: list[Request], token_budget: int) -> dict[str, PoolUse]:
        """Look up (and load) the waiting requests that may be scheduled next: those not yet
        looked up, with nothing computed, in queue order, up to a step's token budget."""
        used: dict[str, PoolUse] = {}
        tokens = 0
        for request in waiting:
            if tokens >= token_budget:
                break
            tokens += request.num_tokens - request.num_computed_tokens
            rid = request.request_id
            if rid in self._probed or request.num_computed_tokens > 0:
                continue
            self._probed.add(rid)
            use = self._load(request)
            if use is not None:
                used[rid] = use
        return used

    def _load(self, request: Request) -> PoolUse | None:
        local, hashes = self.kv.pool_candidates(request)
        if not hashes:
            return None
        bs = self.kv.block_size
        now = time.monotonic()
        self.stats.lookups += 1
        try:
            n = self.pool.lookup(hashes, start=local)  # hashes begin at block `local`
        except Exception as e:  # a tier that fails is a miss, never a failed request
            self._error(e)
            return None
        use = PoolUse(now, n * bs, local_tokens=local * bs)
        self.stats.hit_tokens += n * bs
        if n == 0:
            return use
        deadline = now + self.base_s + self.per_token_s * n * bs
        try:
            kvs = self.pool.get(hashes[:n], deadline, start=local)
        except Exception as e:
            self._error(e)
            kvs = []
        kvs = kvs[: self._valid_run(kvs)]
        ids = self.kv.import_blocks(request, hashes[: len(kvs)])
        for block_id, kv in zip(ids, kvs, strict=False):
            self._write_block(block_id, kv)
        use.loaded_tokens = len(ids) * bs
        use.load_s = time.monotonic() - now
        self.stats.loaded_tokens += use.loaded_tokens
        self.stats.recomputed_tokens += use.hit_tokens - use.loaded_tokens
        self.stats.load_seconds += use.load_s
        return use

    def _valid_run(self, kvs: list[torch.Tensor]) -> int:
        """How many leading tensors have the shape of one block here (a mismatch is a corrupt
        entry as far as this engine is concerned: recomputed, counted)."""
        shape = self._block_shape()
        for i, kv in enumerate(kvs):
            if tuple(kv.shape) != shape:
                self._error(ValueError(f"pool block of shape {tuple(kv.shape)}, need {shape}"))
                return i
        return len(kvs)

    def _block_shape(self) -> tuple[int, ...]:
        return self.cache.layout.block_shape(self.cache.block_size)

    def _write_block(self, block_id: int, kv: torch.Tensor) -> None:
        for layer, (k_cache, v_cache) in enumerate(self.cache.layers):
            k_cache[block_id].copy_(kv[layer, 0])
            v_cache[block_id].copy_(kv[layer, 1])

    def release(self) -> None:
        """After `schedule()`: admitted requests reference their prefix now; the rest find it
        in the prefix cache later (or recompute it, if it was evicted meanwhile)."""
        for rid in self.kv.pinned():
            self.kv.unpin(rid)

    def forget(self, request_id: str) -> None:
        """The request ended (finished or aborted): put its open chunk, forget it."""
        self._probed.discard(request_id)
        self.kv.unpin(request_id)
        self._put_open(request_id)

    # ---- put ---------------------------------------------------------------------------------
    def after_step(self, skip: set[str]) -> None:
        """Right after the model wrote this step's KV: add the blocks registered during the step
        to their requests' open chunks and put each chunk that fills. `skip`: requests preempted
        in the step (their blocks were freed before the model wrote them): their open chunks
        are put as they are."""
        for rid in skip:
            self._put_open(rid)
        for rid, index, block_id, block_hash in self.kv.take_registered():
            if rid in skip or not self.kv.block_holds(block_id, block_hash):
                continue
            self._add(rid, index, block_id, block_hash)

    def _add(self, rid: str, index: int, block_id: int, block_hash: BlockHash) -> None:
        c = self.pool.namespace.chunk_blocks
        start = index - index % c
        blocks = self._open.pop(rid, [])
        if not blocks or blocks[0][0] != start or blocks[-1][0] != index - 1:
            # The chunk's blocks before this one were found cached (or came before a
            # preemption): the request holds them now.
            held = self.kv.registered_blocks(rid, start, index)
            blocks = [(start + i, bid, h) for i, (bid, h) in enumerate(held)]
            if len(blocks) != index - start:  # not expected: a block before a registered one
                self.stats.put_gaps += 1  # is full and registered; counted if it ever happens
                return
        blocks.append((index, block_id, block_hash))
        if len(blocks) < c:
            self._open[rid] = blocks
            return
        # Under a sliding window the chunk's first blocks may have left the window and been
        # taken again meanwhile: only what still holds its KV goes in (from the chunk's start).
        valid = self._holding(blocks)
        self.stats.put_gaps += c - valid
        if valid:
            self._put(blocks[:valid])

    def _put_open(self, rid: str) -> None:
        """Put the request's open chunk as a partial one: its leading blocks that still hold
        their KV (a preempted request's blocks are free, and may be reused by now)."""
        blocks = self._open.pop(rid, [])
        valid = self._holding(blocks)
        if valid:
            self._put(blocks[:valid])

    def _holding(self, blocks: list[tuple[int, int, BlockHash]]) -> int:
        """How many leading blocks still hold the KV they were registered with."""
        valid = 0
        while valid < len(blocks) and self.kv.block_holds(blocks[valid][1], blocks[valid][2]):
            valid += 1
        return valid

    def _put(self, blocks: list[tuple[int, int, BlockHash]]) -> None:
        try:
            ok = self.pool.put(
                blocks[0][0], [h for _, _, h in blocks], [self.read_block(b) for _, b, _ in blocks]
            )
        except Exception as e:
            self._error(e)
            return
        self.stats.put_blocks += len(blocks) if ok else 0
        self.stats.put_drops += 0 if ok else len(blocks)

    def read_block(self, block_id: int) -> torch.Tensor:
        return torch.stack(
            [torch.stack((k[block_id], v[block_id])) for k, v in self.cache.layers]
        ).contiguous()

    def _error(self, e: Exception) -> None:
        self.stats.errors += 1
        self.stats.last_error = f"{type(e).__name__}: {e}"[:200]
