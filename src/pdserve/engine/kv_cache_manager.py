"""KV memory, layer three: `KVCacheManager`, the only KV interface the scheduler uses.

It maps request ids to the blocks they hold, finds cached prefixes, allocates room for the
tokens scheduled next, and frees. Only block ids leave it (`get_block_ids`), never `Block`s, so
callers cannot corrupt reference counts.

Invariant (checked by the tests after every scenario): when no request is alive, every block is
free (`num_free_blocks == num_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.block_pool import ROOT_HASH, Block, BlockHash, BlockPool, hash_full_blocks
from pdserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixHit:
    """Result of a prefix-cache lookup: opaque to callers except for the token count."""

    blocks: list[Block]
    num_tokens: int


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        root_hash: BlockHash = ROOT_HASH,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash
        self._blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of a request already registered
        self.stats = PrefixCacheStats()
        # KV pool (engine/pool_link.py): blocks registered since the last drain, whose KV the
        # current step writes (request id, block index, block id, hash), and blocks held for a
        # request whose prefix was just loaded from the pool, until it is scheduled.
        self.track_registered = False
        self._registered: list[tuple[str, int, int, BlockHash]] = []
        self._pins: dict[str, list[Block]] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """Longest cached run of full blocks of the request's tokens.

        At least one token is always left uncomputed: the model must run on it to produce the
        logits of the next token.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        hit = self._lookup(request, request.num_tokens - 1)
        self._count(request.num_tokens, hit)
        return hit

    def peek_cached_prefix_tokens(self, request: Request) -> int:
        """How many tokens `find_cached_prefix` would find now, without counting a query."""
        if not self.enable_prefix_caching:
            return 0
        return self._lookup(request, request.num_tokens - 1).num_tokens

    def _lookup(self, request: Request, max_tokens: int) -> PrefixHit:
        """Cached leading full blocks covering at most `max_tokens` tokens (no stats)."""
        hashes = self._request_hashes(request)
        max_blocks = max(0, max_tokens) // self.block_size
        hit: list[Block] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return PrefixHit(hit, len(hit) * self.block_size)

    def _count(self, num_tokens: int, hit: PrefixHit) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += hit.num_tokens

    def _request_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            tokens = request.all_token_ids
            parent = hashes[-1] if hashes else self.root_hash
            start = len(hashes) * self.block_size
            hashes.extend(
                hash_full_blocks(
                    tokens[start : num_full * self.block_size], self.block_size, parent
                )
            )
        return hashes

    # ---- allocation ------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones.

        `prefix` is a hit from `find_cached_prefix` for a request that holds no blocks yet.
        Returns the request's full block table, or None (nothing changed) if memory is short.
        """
        held = self._blocks.get(request.request_id, [])
        hit = prefix.blocks if prefix else []
        computed = request.num_computed_tokens + (prefix.num_tokens if prefix else 0)
        need = self.blocks_needed(computed + num_new_tokens) - len(held) - len(hit)
        # Hit blocks that are free count as free now but stop being free once touched.
        reclaimable = sum(1 for b in hit if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimable:
            return None
        self.pool.touch(hit)
        blocks = self._blocks.setdefault(request.request_id, held)
        blocks.extend(hit)
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        self._cache_full_blocks(request, min(computed + num_new_tokens, request.num_tokens))
        return [b.block_id for b in blocks]

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for KV that will arrive from elsewhere (a decode worker's pre-allocation).

        Nothing is registered in the prefix cache: the content is not there yet. It is
        registered when the request is admitted and `allocate_slots` runs for it.
        """
        if request_id in self._blocks:
            raise ValueError(f"request {request_id!r} already holds blocks")
        return self._reserve(request_id, num_tokens, PrefixHit([], 0))

    def reserve_with_prefix(
        self, request: Request, num_tokens: int, max_cached_tokens: int
    ) -> tuple[list[int], int] | None:
        """`reserve`, reusing the request's cached prefix (at most `max_cached_tokens` tokens,
        whole blocks): only the rest has to arrive. Returns (block ids, cached tokens), or None
        (nothing changed, nothing counted) when memory is short.

        The hit blocks are already registered, so they count as registered (`_num_cached`);
        the blocks after them are registered once the request is admitted and scheduled.
        """
        rid = request.request_id
        if rid in self._blocks:
            raise ValueError(f"request {rid!r} already holds blocks")
        hit = PrefixHit([], 0)
        if self.enable_prefix_caching:
            hit = self._lookup(request, min(max_cached_tokens, request.num_tokens - 1))
        block_ids = self._reserve(rid, num_tokens, hit)
        if block_ids is None:
            self._hashes.pop(rid, None)  # a caller that gives up must not leave them behind
            return None
        if self.enable_prefix_caching:
            self._count(request.num_tokens, hit)
        self._num_cached[rid] = len(hit.blocks)
        return block_ids, hit.num_tokens

    def _reserve(self, request_id: str, num_tokens: int, hit: PrefixHit) -> list[int] | None:
        need = self.blocks_needed(num_tokens) - len(hit.blocks)
        # Hit blocks that are free count as free now but stop being free once touched.
        reclaimable = sum(1 for b in hit.blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimable:
            return None
        self.pool.touch(hit.blocks)  # taken before new blocks, so eviction cannot pick them
        self._blocks[request_id] = [*hit.blocks, *self.pool.get_new_blocks(max(0, need))]
        return self.get_block_ids(request_id)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register blocks that will be full once this step has written `num_tokens` tokens."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        done = self._num_cached.get(rid, 0)
        num_full = num_tokens // self.block_size
        if num_full <= done:
            return
        hashes = self._request_hashes(request)
        blocks = self._blocks[rid]
        for i in range(done, num_full):
            if self.pool.cache_block(blocks[i], hashes[i]) and self.track_registered:
                self._registered.append((rid, i, blocks[i].block_id, hashes[i]))
        self._num_cached[rid] = num_full

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Give `child_id` the KV of the parent's first `num_tokens` tokens without copying it:
        the full blocks are shared (one more reference each). The last, partial block is about
        to be written by both (each appends its own next token), so it is copied on write, now:
        the child gets a new block. Returns (source block id, copy block id) for the caller to
        copy the KV of that block, or None when nothing needs copying.

        Raises MemoryError (nothing changed) when no block is free for the copy.
        """
        if child_id in self._blocks:
            raise ValueError(f"request {child_id!r} already holds blocks")
        parent = self._blocks[parent_id]
        num_full, partial = divmod(num_tokens, self.block_size)
        if len(parent) < num_full + (1 if partial else 0):
            raise ValueError(f"{parent_id!r} holds no KV for {num_tokens} tokens")
        if partial and self.pool.num_free_blocks < 1:
            raise MemoryError("no free block to copy the last partial block into")
        shared = parent[:num_full]
        self.pool.touch(shared)
        self._blocks[child_id] = list(shared)
        self._num_cached[child_id] = min(self._num_cached.get(parent_id, 0), num_full)
        if not partial:
            return None
        (copy,) = self.pool.get_new_blocks(1)
        self._blocks[child_id].append(copy)
        return parent[num_full].block_id, copy.block_id

    # ---- KV pool (engine/pool_link.py) ------------------------------------------------------
    def take_registered(self) -> list[tuple[str, int, int, BlockHash]]:
        """Blocks registered since the last call: (request id, index, block id, hash)."""
        out, self._registered = self._registered, []
        return out

    def registered_blocks(
        self, request_id: str, start: int, end: int
    ) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the request's blocks [start, end) while each is registered (a
        full block in the prefix cache); stops at the first that is not."""
        out: list[tuple[int, BlockHash]] = []
        for block in self._blocks.get(request_id, [])[start:end]:
            if block.block_hash is None:
                break
            out.append((block.block_id, block.block_hash))
        return out

    def block_holds(self, block_id: int, block_hash: BlockHash) -> bool:
        """Whether block `block_id` still holds the KV named `block_hash`."""
        return self.pool.blocks[block_id].block_hash == block_hash

    def pool_candidates(self, request: Request) -> tuple[int, list[BlockHash]]:
        """(leading full blocks cached here, hashes of the full blocks after them) of the
        request's tokens but the last (which the model must compute)."""
        if not self.enable_prefix_caching:
            return 0, []
        hashes = self._request_hashes(request)[: max(0, request.num_tokens - 1) // self.block_size]
        local = len(self._lookup(request, request.num_tokens - 1).blocks)
        return local, hashes[local:]

    def import_blocks(self, request: Request, hashes: list[BlockHash]) -> list[int]:
        """Fresh blocks for KV loaded from elsewhere (the pool) that continues the request's
        cached prefix, registered under `hashes` and held (with that prefix) until `unpin`, so
        no allocation evicts them before the request is scheduled and finds them as a prefix
        hit. Takes fewer (maybe none) when free blocks are short; returns their ids in order.
        The caller writes their KV before the next step."""
        rid = request.request_id
        if rid in self._pins or rid in self._blocks:
            raise ValueError(f"request {rid!r} already holds blocks")
        local = self._lookup(request, request.num_tokens - 1).blocks
        reclaimable = sum(1 for b in local if b.ref_cnt == 0)
        n = max(0, min(len(hashes), self.pool.num_free_blocks - reclaimable - 1))
        self.pool.touch(local)  # before taking new blocks, so eviction cannot pick them
        fresh = self.pool.get_new_blocks(n)
        for block, block_hash in zip(fresh, hashes, strict=False):
            self.pool.cache_block(block, block_hash)
        self._pins[rid] = [*local, *fresh]
        return [b.block_id for b in fresh]

    def unpin(self, request_id: str) -> None:
        """Drop `import_blocks`' hold (the request's own blocks now reference what it uses)."""
        blocks = self._pins.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def pinned(self) -> list[str]:
        return list(self._pins)

    def free(self, request_id: str) -> None:
        """Release every block of a request; tail blocks first so they are evicted first."""
        blocks = self._blocks.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # ---- prefix-cache events (what a worker tells routers) --------------------------------
    @property
    def has_events(self) -> bool:
        return self.pool.has_events

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        """(stored, removed, cleared) since the last call; see `BlockPool.take_events`."""
        return self.pool.take_events()

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash in the prefix cache now."""
        return self.pool.cached_hashes()
