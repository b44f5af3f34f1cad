"""The engine's side of the KV pool (issue 15): load a prompt's prefix from the pool before it is
scheduled, and put every full block the engine computes or receives into it.

Load (`prefetch`, before each `schedule()`): for a waiting request not yet looked up, after the
local prefix cache (`KVCacheManager.pool_candidates`), the pool is asked how many of the next
full-block hashes it holds (`lookup`), that run is loaded under a deadline (base + per token),
written into fresh engine blocks registered under those hashes (`import_blocks`), and held until
the scheduler has run once: it then finds them as an ordinary prefix hit and marks those tokens
computed. Whatever the lookup promised but `get` did not return (late, missing, corrupt) is
recomputed, and counted (`recomputed_tokens`). At most the last prompt token is always computed.

Put (`after_step`): blocks the KV manager registered during the step (prompt blocks P computed,
a decode worker's received prompt blocks on its first step, generated blocks as they fill) are
copied out as one tensor [layers, 2, block_size, kv_heads, head_dim] each and handed to
`pool.put`, which never blocks (a full write-back queue drops and counts).

Nothing here changes what the engine computes: a pool hit is KV that some worker with the same
namespace (model, dtype, layout, block size, codec) computed for the same chained hash.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.kvpool.api import KVPool

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
    put_drops: int = 0
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
            n = self.pool.lookup(hashes)
        except Exception as e:  # a tier that fails is a miss, never a failed request
            self._error(e)
            return None
        use = PoolUse(now, n * bs, local_tokens=local * bs)
        self.stats.hit_tokens += n * bs
        if n == 0:
            return use
        deadline = now + self.base_s + self.per_token_s * n * bs
        try:
            kvs = self.pool.get(hashes[:n], deadline)
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
        k = self.cache.layers[0][0]
        return (len(self.cache.layers), 2, k.shape[1], k.shape[2], k.shape[3])

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
        self._probed.discard(request_id)
        self.kv.unpin(request_id)

    # ---- put ---------------------------------------------------------------------------------
    def after_step(self, skip: set[str]) -> None:
        """Put the blocks registered during the step (their KV is written now); `skip`: requests
        preempted in the step (their blocks were freed before the model wrote them)."""
        for rid, _, block_id, block_hash in self.kv.take_registered():
            if rid in skip or not self.kv.block_holds(block_id, block_hash):
                continue
            try:
                ok = self.pool.put(block_hash, self.read_block(block_id))
            except Exception as e:
                self._error(e)
                continue
            self.stats.put_blocks += ok
            self.stats.put_drops += not ok

    def read_block(self, block_id: int) -> torch.Tensor:
        return torch.stack(
            [torch.stack((k[block_id], v[block_id])) for k, v in self.cache.layers]
        ).contiguous()

    def _error(self, e: Exception) -> None:
        self.stats.errors += 1
        self.stats.last_error = f"{type(e).__name__}: {e}"[:200]
