"""KV for a model whose layers mix sliding-window and global attention (Gemma 2/3; Qwen2/3 with
`max_window_layers`): one KV group per kind of layer, as vLLM's hybrid KV cache manager does.

The global layers (window None) and the sliding layers (window W) each have their own blocks
(engine/kv_cache.py: a sliding layer's tensors have `sliding_blocks` blocks) and their own block
table per request, kept by one `KVCacheManager` each: `full` (no window) and `sliding` (window
W, which frees the blocks that leave the window, as on a model windowed on every layer). So a
sliding layer holds only its window's KV however long the context grows; with one table shared
by every layer it would hold the whole context, as the global layers must.

`HybridKVCacheManager` offers the scheduler and the engine the interface of one manager:
  * allocation is atomic: both groups are planned (`plan_slots`), both must fit (kept turns go
    first, as in each manager), then both take their blocks; otherwise neither changes;
  * a prefix hit needs the global group's blocks for the whole hit and the sliding group's for
    the window before the hit's end: the global group's longest hit, then the sliding group's
    lookup within it, cut to the shorter (a prefix of a hit is a hit);
  * free, trim (speculation), fork (n > 1), kept turns and the prefix-cache reset act on both;
  * block counts (`num_blocks`, `num_free_blocks`, kept) are both groups' sums (blocks of
    different sizes: a global block holds the global layers, a sliding one the sliding
    layers), `usage` the fuller group's share.
Models with no window, or one window on every layer, keep one plain `KVCacheManager`.

With a KV pool (engine/pool_link.py, engine/pool_group.py) each group puts and loads its own
layers under its own namespace; a load ends where both groups can make the hit, by the rule
above, and `pinned` covers both groups' held blocks.

Sizing (`split_blocks`): from the budget of the shared layout (N blocks of every layer), the
sliding group gets what its running requests can hold at once plus a quarter for its prefix
cache, and never more than N; the global group gets the rest of the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.block_pool import ROOT_HASH, Block, BlockHash
from pdserve.engine.kept_turns import KeptTurns
from pdserve.engine.kv_cache_manager import KVCacheManager, SlotPlan
from pdserve.engine.kv_window import PrefixCacheStats, PrefixHit, cdiv
from pdserve.engine.request import Request


@dataclass(frozen=True)
class GroupSizes:
    full: int  # blocks of the global layers
    sliding: int  # blocks of the sliding layers
    steady: int  # what the running requests hold at most in the sliding group


def split_blocks(
    num_blocks: int,
    num_layers: int,
    num_sliding: int,
    window: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> GroupSizes:
    """The two groups' blocks from the memory of `num_blocks` blocks of all `num_layers` layers.

    Each running sequence holds at most cdiv(window - 1 + n, block_size) + 1 sliding blocks in a
    step computing n of its tokens (kv_window.peak_blocks), at most cdiv(window - 1, block_size)
    + 2 + n / block_size; the n of one step add up to max_num_batched_tokens. So the running
    requests hold at most `steady` = max_num_seqs * (cdiv(window - 1, block_size) + 2) +
    cdiv(max_num_batched_tokens, block_size). A quarter more keeps recent window blocks cached
    for prefix hits and kept turns. Capped at `num_blocks` (the shared layout's share): the
    global group then has at least the shared layout's blocks."""
    steady = max_num_seqs * (cdiv(window - 1, block_size) + 2)
    steady += cdiv(max_num_batched_tokens, block_size)
    sliding = max(2, min(num_blocks, steady + steady // 4))  # 2: the null block and one
    num_full = num_layers - num_sliding
    full = (num_blocks * num_layers - sliding * num_sliding) // num_full
    return GroupSizes(full, sliding, steady)


@dataclass
class HybridHit(PrefixHit):
    """A prefix hit in both groups (`blocks`: the global group's)."""

    sliding: PrefixHit | None = None


class HybridKVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        sliding_blocks: int,
        block_size: int,
        window: int,
        enable_prefix_caching: bool = True,
        root_hash: BlockHash = ROOT_HASH,
        conversation_ttl_s: float = 0.0,
    ) -> None:
        self.full = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching, root_hash, None, conversation_ttl_s
        )
        self.sliding = KVCacheManager(
            sliding_blocks, block_size, enable_prefix_caching, root_hash, window, conversation_ttl_s
        )
        self.groups = (self.full, self.sliding)
        self.block_size, self.window = block_size, window
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(g.num_free_blocks for g in self.groups)

    @property
    def usage(self) -> float:
        return max(g.usage for g in self.groups)

    @property
    def num_cached_blocks(self) -> int:
        """The global group's: every prefix hit is a run of them."""
        return self.full.num_cached_blocks

    @property
    def kept(self) -> KeptTurns[Block]:
        """The global group's kept turns (the sliding group keeps the same turns' windows)."""
        return self.full.kept

    @property
    def num_kept_blocks(self) -> int:
        return sum(g.num_kept_blocks for g in self.groups)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.full.get_block_ids(request_id)

    def sliding_block_ids(self, request_id: str) -> list[int] | None:
        return self.sliding.get_block_ids(request_id)

    def has_request(self, request_id: str) -> bool:
        return self.full.has_request(request_id)

    def blocks_needed(self, num_tokens: int) -> int:
        return self.full.blocks_needed(num_tokens)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """The global group's (the sliding group's is at most its window's)."""
        return self.full.peak_blocks(num_tokens, chunk)

    def fits(self, num_tokens: int, chunk: int) -> bool:
        return all(g.fits(num_tokens, chunk) for g in self.groups)

    # ---- prefix cache ----------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> HybridHit:
        hit = self._lookup(request, request.num_tokens - 1)
        if self.enable_prefix_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += hit.num_tokens
        return hit

    def peek_cached_prefix_tokens(self, request: Request) -> int:
        return self._lookup(request, request.num_tokens - 1).num_tokens

    def _lookup(self, request: Request, max_tokens: int) -> HybridHit:
        """The global group's longest hit, cut to the sliding group's within it."""
        if not self.enable_prefix_caching:
            return HybridHit([], 0, PrefixHit([], 0))
        full = self.full._lookup(request, max_tokens)
        sliding = self.sliding._lookup(request, full.num_tokens)
        n = len(sliding.blocks)
        return HybridHit(full.blocks[:n], sliding.num_tokens, sliding)

    @staticmethod
    def _split(prefix: PrefixHit | None) -> tuple[PrefixHit | None, PrefixHit | None]:
        if not isinstance(prefix, HybridHit) or prefix.sliding is None:
            return None, None  # no hit (the scheduler passes PrefixHit([], 0))
        return PrefixHit(prefix.blocks, prefix.num_tokens), prefix.sliding

    # ---- allocation ------------------------------------------------------------------------
    def _short(self, plans: list[SlotPlan]) -> bool:
        """Whether the plans do not fit both groups, after releasing kept turns as far as that
        helps (KVCacheManager._short): the oldest conversation's blocks in both groups at once,
        since either half alone makes no hit."""
        pairs = list(zip(self.groups, plans, strict=True))
        while not all(g.fits_now(p.need, p.hit) for g, p in pairs):
            key = self.full.kept.oldest() or self.sliding.kept.oldest()
            if key is None:
                return True
            for g in self.groups:
                g._drop(g.kept.release(key, "pressure"))
        return False

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None
    ) -> list[int] | None:
        """Both groups' room, or neither's (KVCacheManager.allocate_slots); the global
        group's table (`sliding_block_ids`: the sliding one's)."""
        hits = self._split(prefix)
        plans = [
            g.plan_slots(request, num_new_tokens, h) for g, h in zip(self.groups, hits, strict=True)
        ]
        if self._short(plans):
            return None
        for g, plan in zip(self.groups, plans, strict=True):
            g.commit_slots(request, num_new_tokens, plan)
        return self.full.get_block_ids(request.request_id)

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        none = PrefixHit([], 0)
        plans = [g.plan_reserve(request_id, num_tokens, none) for g in self.groups]
        if self._short(plans):
            return None
        for g, plan in zip(self.groups, plans, strict=True):
            g._commit_reserve(request_id, plan)
        return self.full.get_block_ids(request_id)

    def reserve_with_prefix(
        self, request: Request, num_tokens: int, max_cached_tokens: int, complete_from: int = 0
    ) -> tuple[list[int], int] | None:
        """KVCacheManager.reserve_with_prefix over both groups. `complete_from` (the first
        token whose KV arrives for every layer) is the sliding layers' window start: the global
        layers receive every token after the hit, so their group registers all of them."""
        rid = request.request_id
        hit = self._lookup(request, min(max_cached_tokens, request.num_tokens - 1))
        full_hit, sliding_hit = self._split(hit)
        hits = (full_hit or PrefixHit([], 0), sliding_hit or PrefixHit([], 0))
        plans = [g.plan_reserve(rid, num_tokens, h) for g, h in zip(self.groups, hits, strict=True)]
        if self._short(plans):
            for g in self.groups:
                g._hashes.pop(rid, None)
            return None
        self.full.commit_reserve(request, plans[0], hits[0], 0)
        self.sliding.commit_reserve(request, plans[1], hits[1], complete_from)
        if self.enable_prefix_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += hit.num_tokens
        return self.full.get_block_ids(rid), hit.num_tokens

    def fork_copies(
        self, parent_id: str, child_id: str, num_tokens: int
    ) -> list[tuple[int, int, int]]:
        """KVCacheManager.fork in both groups (group 0 global, 1 sliding), or MemoryError with
        nothing changed: a partial last block needs a free block in each group."""
        one = SlotPlan([], 1, [])  # a block for the copy in each group
        if num_tokens % self.block_size and self._short([one, one]):
            raise MemoryError("no free block to copy the last partial block into")
        return [
            (i, *copy)
            for i, g in enumerate(self.groups)
            if (copy := g.fork(parent_id, child_id, num_tokens)) is not None
        ]

    def trim(self, request_id: str, num_tokens: int) -> None:
        for g in self.groups:
            g.trim(request_id, num_tokens)

    def free(self, request_id: str) -> None:
        for g in self.groups:
            g.free(request_id)

    def pinned(self) -> list[str]:
        """Requests holding blocks loaded from the KV pool in either group (pool_link.py)."""
        return sorted(set(self.full.pinned()) | set(self.sliding.pinned()))

    def reset_prefix_cache(self) -> int:
        """Forget both groups' cached blocks; returns the global group's count."""
        full, _ = (g.reset_prefix_cache() for g in self.groups)
        return full

    # ---- conversations (kept_turns.py) -------------------------------------------------------
    def keep_turn(self, request_id: str, conversation: str) -> int:
        """Both groups keep the turn: the global group its whole KV, the sliding group the
        window at its end (all the next turn's hit there needs). Returns the global count."""
        full, _ = (g.keep_turn(request_id, conversation) for g in self.groups)
        return full

    def mark_turn(self, request: Request, conversation: str) -> None:
        self.full.mark_turn(request, conversation)  # counts the follow-up once

    def expire_kept(self) -> None:
        for g in self.groups:
            g.expire_kept()

    # ---- prefix-cache events (what a worker tells routers) --------------------------------
    # The router matches a request's block hashes from the first on against a worker's set. A
    # hit here needs the global group's blocks for all of it, and the sliding group's for the
    # window before its end only; the sliding group's set is mostly recent windows (its blocks
    # are few and evicted soon), so hashes both groups hold would rarely start a prefix. The
    # global group's set is what a hit needs everywhere: it is reported, the sliding group's
    # events dropped. A router may then expect a hit whose window the sliding group evicted:
    # the request runs correctly, only computing more.
    @property
    def has_events(self) -> bool:
        return self.full.has_events

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        self.sliding.take_events()  # not reported (above); drained so they do not pile up
        return self.full.take_events()

    def cached_hashes(self) -> list[BlockHash]:
        return self.full.cached_hashes()


# What the scheduler and the engine hold: one manager, or one per KV group.
KVManager = KVCacheManager | HybridKVCacheManager
