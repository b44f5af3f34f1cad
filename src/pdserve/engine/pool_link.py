"""The engine's side of the KV pool (issue 15): load a prompt's prefix from the pool before it is
scheduled, and put every full block the engine computes or receives into it.

Load (`prefetch`, before each `schedule()`): for a waiting request not yet looked up, after the
local prefix cache (`KVCacheManager.pool_candidates`), the pool is asked how many of the next
full-block hashes it holds (`lookup`), that run is loaded under a deadline (base + per token),
written into fresh engine blocks registered under those hashes (`import_blocks`), and held until
the scheduler has run once: it then finds them as an ordinary prefix hit and marks those tokens
computed. Whatever the lookup promised but `get` did not return (late, missing, corrupt) is
recomputed, and counted (`recomputed_tokens`). At most the last prompt token is always computed.

KV groups (engine/hybrid_kv.py): each group loads and puts its own layers under its own
namespace (engine/pool_group.py). A hit needs the global group's blocks for all of it and the
sliding group's for the window before its end, as a local prefix hit does: the global group's
run in the pool gives the hit's end G; the sliding group needs blocks [G - w, G) (w =
cdiv(window - 1, block_size), all of [0, G) when G <= w), from its local cache or else from the
pool; when the pool's run of them stops short, the hit ends where that run ends if the window
before that is cached here, else the pool adds nothing. Both groups' blocks are loaded, written
and registered; the scheduler's prefix lookup then finds the hit on both, and what it finds
beyond the local hit is what was loaded (the rest of the promise is recomputed, counted).

Put (`after_step`, right after the model ran): each group adds the blocks its manager registered
during the step to their requests' open chunks and puts the chunks that fill (pool_group.py);
the open rest is put when the request ends (`forget`: finished or aborted) or is preempted.
Trade-off: up to C-1 of a running request's newest blocks are in no pool until then - a D
killed mid-answer loses them, and the request's recovery recomputes them (the kvpool-serve
recovery benchmark reports loaded vs recomputed tokens).

Nothing here changes what the engine computes: a pool hit is KV that some worker with the same
namespace (model, dtype, layout, block size, codec, chunk size, a group's layers) computed for
the same chained hash.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine.hybrid_kv import HybridKVCacheManager, KVManager
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.engine.kv_window import cdiv
from pdserve.engine.pool_group import SLIDING_CHUNK_BLOCKS, GroupLink, PutStats
from pdserve.engine.request import Request
from pdserve.kvpool.api import BlockHash, KVPool, PoolNamespace

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
class PoolLinkStats(PutStats):
    lookups: int = 0
    hit_tokens: int = 0
    loaded_tokens: int = 0
    recomputed_tokens: int = 0  # promised by lookup, not delivered by get: computed instead
    load_seconds: float = 0.0
    errors: int = 0  # a pool call raised: treated as a miss, counted
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items()}


def group_namespaces(ns: PoolNamespace, layer_group: list[int]) -> list[PoolNamespace]:
    """The namespaces of a two-group cache's values: the global group's layers in the pool's
    chunks, the sliding group's one block per value (engine/pool_group.py)."""
    full = [i for i, g in enumerate(layer_group) if g == 0]
    sliding = [i for i, g in enumerate(layer_group) if g == 1]
    return [ns.for_layers(full, ns.chunk_blocks), ns.for_layers(sliding, SLIDING_CHUNK_BLOCKS)]


@dataclass
class PoolLink:
    pool: KVPool
    cache: PagedKVCache
    kv: KVManager
    base_s: float = LOAD_BASE_S
    per_token_s: float = LOAD_PER_TOKEN_S
    stats: PoolLinkStats = field(default_factory=PoolLinkStats)
    _probed: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.kv.enable_prefix_caching:
            raise ValueError("the KV pool works through the prefix cache: enable prefix caching")
        ns = self.pool.namespace
        if ns.block_size != self.kv.block_size:
            raise ValueError(
                f"the pool's namespace has block size {ns.block_size}, the engine "
                f"{self.kv.block_size}"
            )
        if ns.layers:
            raise ValueError(f"the pool's namespace must name every layer, not {ns.layers}")
        if isinstance(self.kv, HybridKVCacheManager):
            spaces = group_namespaces(ns, self.cache.layer_group)
            managers = (self.kv.full, self.kv.sliding)
            self.groups = [
                GroupLink(self.pool.for_namespace(s), self.cache, m, g, self.stats)
                for g, (s, m) in enumerate(zip(spaces, managers, strict=True))
            ]
        else:
            self.groups = [GroupLink(self.pool, self.cache, self.kv, 0, self.stats)]

    @property
    def namespace(self) -> PoolNamespace:
        """The global group's (every layer's with one group): the keys of the block hashes a
        worker reports, which the router's pool index matches."""
        return self.groups[0].pool.namespace

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
            load = self._load if len(self.groups) == 1 else self._load_groups
            use = load(request)
            if use is not None:
                used[rid] = use
        return used

    def _load(self, request: Request) -> PoolUse | None:
        (group,) = self.groups
        local, hashes = group.kv.pool_candidates(request)
        if not hashes:
            return None
        bs = self.kv.block_size
        now = time.monotonic()
        self.stats.lookups += 1
        n = self._lookup(group, hashes, local)  # hashes begin at block `local`
        if n is None:
            return None
        use = PoolUse(now, n * bs, local_tokens=local * bs)
        if n:
            kvs = self._fetch(group, hashes[:n], local, self._deadline(now, n))
            ids = group.kv.import_blocks(request, hashes[: len(kvs)])
            group.write(ids, kvs)
            use.loaded_tokens = len(ids) * bs
        return self._count(use)

    def _load_groups(self, request: Request) -> PoolUse | None:
        """`_load` for two KV groups (the module docstring): the hit's end from the global
        group's run, the sliding group's window before it, both loaded."""
        full, sliding = self.groups
        bs = self.kv.block_size
        local = self.kv.peek_cached_prefix_tokens(request) // bs  # both groups' local hit
        f_local, rest = full.kv.pool_candidates(request)
        chain = full.kv.chain(request)
        if not chain:
            return None
        now = time.monotonic()
        self.stats.lookups += 1
        n = self._lookup(full, rest, f_local) if rest else 0
        if n is None:
            return None
        end, first = self._sliding_end(chain, local, f_local + n)
        use = PoolUse(now, max(0, end - local) * bs, local_tokens=local * bs)
        if end <= local:
            return self._count(use)
        deadline = self._deadline(now, use.hit_tokens // bs)
        kvs = self._fetch(full, chain[f_local:end], f_local, deadline) if end > f_local else []
        full.write(full.kv.import_blocks(request, chain[f_local : f_local + len(kvs)]), kvs)
        kvs = self._fetch(sliding, chain[first:end], first, deadline) if end > first else []
        held = chain[max(0, end - self._window_blocks()) : min(first, end)]
        sliding.write(sliding.kv.import_window(request, held, chain[first : first + len(kvs)]), kvs)
        found = self.kv.peek_cached_prefix_tokens(request) // bs  # what the scheduler will find
        use.loaded_tokens = min(use.hit_tokens, max(0, found - local) * bs)
        return self._count(use)

    def _window_blocks(self) -> int:
        """Blocks before a hit's end the sliding group needs (kv_window.window_lookup)."""
        assert isinstance(self.kv, HybridKVCacheManager)
        return cdiv(self.kv.window - 1, self.kv.block_size)

    def _sliding_end(self, chain: list[BlockHash], local: int, end: int) -> tuple[int, int]:
        """(the hit's end, the first block the sliding group loads) for a global run to `end`:
        the window before `end` from the sliding group's cache, then from its pool; a run that
        stops short ends the hit there if the window before that is cached, else at `local`."""
        sliding = self.groups[1]
        w = self._window_blocks()
        start = max(0, end - w)
        cached = [sliding.kv.pool.get_cached_block(h) is not None for h in chain[:end]]
        first = next((i for i in range(start, end) if not cached[i]), end)
        if first == end:
            return end, end
        n = self._lookup(sliding, chain[first:end], first) or 0
        short = first + n
        if short == end or all(cached[max(0, short - w) : start]):
            return max(short, local), first
        return local, first

    def _lookup(self, group: GroupLink, hashes: list[BlockHash], start: int) -> int | None:
        try:
            return group.pool.lookup(hashes, start=start)
        except Exception as e:  # a tier that fails is a miss, never a failed request
            self._error(e)
            return None

    def _deadline(self, now: float, blocks: int) -> float:
        return now + self.base_s + self.per_token_s * blocks * self.kv.block_size

    def _fetch(
        self, group: GroupLink, hashes: list[BlockHash], start: int, deadline: float
    ) -> list[torch.Tensor]:
        """The leading blocks `get` returned with the group's block shape (a tier that fails,
        or a block of another shape, ends the run: recomputed, counted)."""
        try:
            kvs = group.pool.get(hashes, deadline, start=start)
        except Exception as e:
            self._error(e)
            return []
        n, err = group.valid_run(kvs)
        if err is not None:
            self._error(err)
        return kvs[:n]

    def _count(self, use: PoolUse) -> PoolUse:
        use.load_s = time.monotonic() - use.lookup_at
        self.stats.hit_tokens += use.hit_tokens
        self.stats.loaded_tokens += use.loaded_tokens
        self.stats.recomputed_tokens += use.hit_tokens - use.loaded_tokens
        self.stats.load_seconds += use.load_s
        return use

    def release(self) -> None:
        """After `schedule()`: admitted requests reference their prefix now; the rest find it
        in the prefix cache later (or recompute it, if it was evicted meanwhile)."""
        for group in self.groups:
            for rid in group.kv.pinned():
                group.kv.unpin(rid)

    def forget(self, request_id: str) -> None:
        """The request ended (finished or aborted): put its open chunks, forget it."""
        self._probed.discard(request_id)
        for group in self.groups:
            group.kv.unpin(request_id)
            self._errors(group.put_open(request_id))

    # ---- put ---------------------------------------------------------------------------------
    def after_step(self, skip: set[str]) -> None:
        """Right after the model wrote this step's KV: each group puts the chunks its blocks
        registered during the step fill (pool_group.py). `skip`: requests preempted in the
        step (their blocks were freed before the model wrote them): their open chunks are put
        as they are."""
        for group in self.groups:
            self._errors(group.after_step(skip))

    def _errors(self, errors: list[Exception]) -> None:
        for e in errors:
            self._error(e)

    def _error(self, e: Exception) -> None:
        self.stats.errors += 1
        self.stats.last_error = f"{type(e).__name__}: {e}"[:200]
