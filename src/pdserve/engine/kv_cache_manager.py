"""KV memory, layer three: `KVCacheManager`, the only KV interface the scheduler uses.

It maps request ids to the blocks they hold, finds cached prefixes, allocates room for the
tokens scheduled next, and frees. Only block ids leave it (`get_block_ids`), never `Block`s, so
callers cannot corrupt reference counts.

Under a sliding window on every layer (`window`, Mistral), a request keeps only the blocks its
next query can see: as its first uncomputed position p moves, the blocks wholly before
p - window + 1 go back to the pool (their content stays valid, so they stay in the prefix cache
until evicted, as any freed block). The block table keeps its positions: a freed entry is None
here and the null block's id in `get_block_ids` (a block no request owns, taken out of the pool
at start), so token t still lives at table[t // block_size] and the kernels, which start at the
window's first block, index it unchanged. A prefix hit then needs only the blocks before its
end that the window covers (`kv_window.window_lookup`, found from the right as vLLM's
SlidingWindowManager does), and requests hold at most cdiv(window - 1 + chunk, block_size) + 1
blocks (`peak_blocks`), which is what admission counts.

Invariant (checked by the tests after every scenario): when no request is alive, every block is
free (`num_free_blocks == num_blocks`).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from pdserve.engine import kv_window
from pdserve.engine.block_pool import ROOT_HASH, Block, BlockHash, BlockPool, hash_full_blocks
from pdserve.engine.kept_turns import KeptTurns
from pdserve.engine.kv_pool_blocks import PoolBlocks
from pdserve.engine.kv_window import PrefixCacheStats, PrefixHit, cdiv
from pdserve.engine.request import Request

__all__ = ["KVCacheManager", "PrefixCacheStats", "PrefixHit", "SlotPlan", "cdiv"]


@dataclass
class SlotPlan:
    """What `allocate_slots` or `reserve` will do, worked out before anything is taken, so a
    caller holding several managers (engine/hybrid_kv.py) can check that all of them fit first.
    `blocks`: the entries to put after the request's held ones (the hit's, None for positions
    out of the window); `need`: new blocks to take after them; `hit`: the cached blocks
    among `blocks`, which `_short` counts."""

    blocks: list[Block | None]
    need: int
    hit: list[Block | None]
    end: int = 0  # tokens with KV after the step (allocate_slots registers the full blocks)


class KVCacheManager(PoolBlocks):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        root_hash: BlockHash = ROOT_HASH,
        window: int | None = None,
        conversation_ttl_s: float = 0.0,
    ) -> None:
        """`window`: the sliding window of every layer (ModelArch.uniform_window), or None.
        `conversation_ttl_s`: how long a finished turn's blocks are kept for its conversation's
        next turn (`keep_turn`; 0: not kept)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if window is not None and (window < 1 or num_blocks < 2):
            raise ValueError(f"a window needs window >= 1 and 2 blocks, got {window}, {num_blocks}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash
        self.window = window
        # Where the table entries of blocks that left the window point; never freed.
        self.null_block: Block | None = self.pool.get_new_blocks(1)[0] if window else None
        self._blocks: dict[str, list[Block | None]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of a request already registered
        self.stats = PrefixCacheStats()
        # KV pool (engine/pool_link.py): blocks registered since the last drain, whose KV the
        # current step writes (request id, block index, block id, hash), and blocks held for a
        # request whose prefix was just loaded from the pool, until it is scheduled.
        self.track_registered = False
        self._registered: list[tuple[str, int, int, BlockHash]] = []
        self._pins: dict[str, list[Block]] = {}
        # finished turns' blocks held for their conversations' next turns (kept_turns.py)
        self.kept: KeptTurns[Block] = KeptTurns(conversation_ttl_s, time.monotonic)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the null block is none of them)."""
        return self.pool.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        null = self.null_block.block_id if self.null_block is not None else -1
        return [null if b is None else b.block_id for b in self._blocks.get(request_id, ())]

    def sliding_block_ids(self, request_id: str) -> list[int] | None:
        """The sliding layers' own block table: None, they share this one (hybrid_kv.py)."""
        return None

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    def has_request(self, request_id: str) -> bool:
        return request_id in self._blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a request holds at once (kv_window.peak_blocks)."""
        return kv_window.peak_blocks(self.window, self.block_size, num_tokens, chunk)

    def fits(self, num_tokens: int, chunk: int) -> bool:
        """Whether a request whose KV grows to `num_tokens` tokens ever fits the whole cache."""
        return self.peak_blocks(num_tokens, chunk) <= self.num_blocks

    def _out_of_window(self, position: int) -> int:
        return kv_window.out_of_window(self.window, self.block_size, position)

    def _slide(self, blocks: list[Block | None], position: int) -> None:
        """Free the blocks that left the window of `position` (entries become None). Each call
        frees from where the last stopped, so walking back stops at the first None."""
        freed: list[Block] = []
        for i in range(min(len(blocks), self._out_of_window(position)) - 1, -1, -1):
            block = blocks[i]
            if block is None:
                break
            freed.append(block)
            blocks[i] = None
        self.pool.free_blocks(reversed(freed))  # the oldest evicted first

    def _in_window(self, hit: list[Block | None], position: int) -> list[Block | None]:
        """A hit's entries, None for those before the window of `position` (left untouched)."""
        skip = self._out_of_window(position)
        return [None if i < skip else b for i, b in enumerate(hit)]

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
        if self.window is not None:
            return kv_window.window_lookup(
                self.pool, hashes[:max_blocks], self.window, self.block_size
            )
        hit: list[Block | None] = []
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
        Under a window, blocks that left the window of the first new token are freed first
        (even when the rest does not fit: nothing will read them again).
        """
        plan = self.plan_slots(request, num_new_tokens, prefix)
        if self._short(plan.need, plan.hit):
            return None
        self.commit_slots(request, num_new_tokens, plan)
        return self.get_block_ids(request.request_id)

    def plan_slots(
        self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None
    ) -> SlotPlan:
        """`allocate_slots` up to the memory check; only frees blocks out of the window."""
        held = self._blocks.get(request.request_id, [])
        computed = request.num_computed_tokens + (prefix.num_tokens if prefix else 0)
        self._slide(held, computed)
        hit = self._in_window(prefix.blocks, computed) if prefix else []
        have = max(len(held) + len(hit), self._out_of_window(computed))
        need = self.blocks_needed(computed + num_new_tokens) - have
        pad = [None] * (have - len(held) - len(hit))
        return SlotPlan([*hit, *pad], need, hit, computed + num_new_tokens)

    def commit_slots(self, request: Request, num_new_tokens: int, plan: SlotPlan) -> None:
        """Take what `plan_slots` planned (the caller checked it fits: `_short`)."""
        self.pool.touch(b for b in plan.hit if b is not None)
        blocks = self._blocks.setdefault(request.request_id, [])
        blocks.extend(plan.blocks)
        if plan.need > 0:
            blocks.extend(self.pool.get_new_blocks(plan.need))
        self._cache_full_blocks(request, min(plan.end, request.num_tokens))

    def _short(self, need: int, hit: list[Block | None]) -> bool:
        """Whether `need` new blocks do not fit beside the hit's, after releasing kept turns
        (oldest first) as far as that helps: a kept turn goes before a request waits or is
        preempted."""
        while not self.fits_now(need, hit):
            kept = self.kept.pop_oldest()
            if kept is None:
                return True
            self._drop(kept)
        return False

    def fits_now(self, need: int, hit: list[Block | None]) -> bool:
        """Whether `need` new blocks fit beside the hit's now. Hit blocks that are free count
        as free now but stop being free once touched."""
        reclaimable = sum(1 for b in hit if b is not None and b.ref_cnt == 0)
        return need <= self.pool.num_free_blocks - reclaimable

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for KV that will arrive from elsewhere (a decode worker's pre-allocation).

        Nothing is registered in the prefix cache: the content is not there yet. It is
        registered when the request is admitted and `allocate_slots` runs for it.
        """
        return self._reserve(request_id, num_tokens, PrefixHit([], 0))

    def reserve_with_prefix(
        self, request: Request, num_tokens: int, max_cached_tokens: int, complete_from: int = 0
    ) -> tuple[list[int], int] | None:
        """`reserve`, reusing the request's cached prefix (at most `max_cached_tokens` tokens,
        whole blocks): only the rest has to arrive. Returns (block ids, cached tokens), or None
        (nothing changed, nothing counted) when memory is short.

        The hit blocks are already registered, so they count as registered (`_num_cached`);
        the blocks after them are registered once the request is admitted and scheduled.
        `complete_from`: the first token whose KV will arrive for every layer (a sender gives
        a windowed layer only its window): blocks after the hit and before it are never
        registered, since some layer of theirs stays unfilled.
        """
        hit = self.reserve_lookup(request, max_cached_tokens)
        plan = self.plan_reserve(request.request_id, num_tokens, hit)
        if self._short(plan.need, plan.hit):
            self._hashes.pop(request.request_id, None)  # a caller that gives up leaves none
            return None
        self.commit_reserve(request, plan, hit, complete_from)
        return self.get_block_ids(request.request_id), hit.num_tokens

    def reserve_lookup(self, request: Request, max_cached_tokens: int) -> PrefixHit:
        """The cached prefix `reserve_with_prefix` reuses (no stats)."""
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        return self._lookup(request, min(max_cached_tokens, request.num_tokens - 1))

    def commit_reserve(
        self, request: Request, plan: SlotPlan, hit: PrefixHit, complete_from: int
    ) -> None:
        """Take what `plan_reserve` planned for `reserve_with_prefix` and count its hit."""
        rid = request.request_id
        self._commit_reserve(rid, plan)
        if self.enable_prefix_caching:
            self._count(request.num_tokens, hit)
        self._num_cached[rid] = max(len(hit.blocks), cdiv(complete_from, self.block_size))

    def _reserve(self, request_id: str, num_tokens: int, hit: PrefixHit) -> list[int] | None:
        plan = self.plan_reserve(request_id, num_tokens, hit)
        if self._short(plan.need, plan.hit):
            return None
        self._commit_reserve(request_id, plan)
        return self.get_block_ids(request_id)

    def plan_reserve(self, request_id: str, num_tokens: int, hit: PrefixHit) -> SlotPlan:
        """Blocks for `num_tokens` tokens of a request holding none, after the hit's."""
        if request_id in self._blocks:
            raise ValueError(f"request {request_id!r} already holds blocks")
        # The last token is computed here: blocks before its window need no KV (None).
        hit_blocks = self._in_window(hit.blocks, num_tokens - 1)
        have = max(len(hit_blocks), self._out_of_window(num_tokens - 1))
        pad = [None] * (have - len(hit_blocks))
        return SlotPlan([*hit_blocks, *pad], self.blocks_needed(num_tokens) - have, hit_blocks)

    def _commit_reserve(self, request_id: str, plan: SlotPlan) -> None:
        # hit blocks taken before new blocks, so eviction cannot pick them
        self.pool.touch(b for b in plan.hit if b is not None)
        self._blocks[request_id] = [*plan.blocks, *self.pool.get_new_blocks(max(0, plan.need))]

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
            block = blocks[i]
            if block is None:  # out of the window: freed, or its KV never came here
                continue
            if self.pool.cache_block(block, hashes[i]) and self.track_registered:
                self._registered.append((rid, i, block.block_id, hashes[i]))
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
        if partial and self._short(1, []):
            raise MemoryError("no free block to copy the last partial block into")
        shared = parent[:num_full]
        self.pool.touch(b for b in shared if b is not None)
        self._blocks[child_id] = list(shared)
        self._num_cached[child_id] = min(self._num_cached.get(parent_id, 0), num_full)
        if not partial:
            return None
        source = parent[num_full]
        assert source is not None, "the block of the last computed token is in its window"
        (copy,) = self.pool.get_new_blocks(1)
        self._blocks[child_id].append(copy)
        return source.block_id, copy.block_id

    def fork_copies(
        self, parent_id: str, child_id: str, num_tokens: int
    ) -> list[tuple[int, int, int]]:
        """`fork`, its copy as (KV group, source, copy) (one group here: 0; engine/hybrid_kv.py
        has two)."""
        copy = self.fork(parent_id, child_id, num_tokens)
        return [] if copy is None else [(0, *copy)]

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the request's blocks past those holding its first `num_tokens` tokens (a
        speculative step's rejected drafts). They were never registered: registration stops
        at the request's real tokens (`_cache_full_blocks`)."""
        blocks = self._blocks.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if not blocks or len(blocks) <= keep:
            return
        assert self._num_cached.get(request_id, 0) <= keep, "a trimmed block was registered"
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(b for b in reversed(tail) if b is not None)

    def free(self, request_id: str) -> None:
        """Release every block of a request; tail blocks first so they are evicted first."""
        blocks = self._blocks.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(b for b in reversed(blocks) if b is not None)

    def reset_prefix_cache(self) -> int:
        self._drop(self.kept.clear())
        return self.pool.reset_prefix_cache()

    # ---- conversations (kept_turns.py) -------------------------------------------------------
    @property
    def num_kept_blocks(self) -> int:
        """Blocks only kept turns hold (no request uses them): free for the asking."""
        refs = collections.Counter(b.block_id for b in self.kept.items())
        return sum(1 for bid, n in refs.items() if self.pool.blocks[bid].ref_cnt == n)

    def keep_turn(self, request_id: str, conversation: str) -> int:
        """Hold the finished request's full registered blocks (prompt and answer) for its
        conversation's next turn, replacing the conversation's previous turn; call before
        `free`. Returns the blocks kept (0 when keeping is off)."""
        blocks = [
            b
            for b in self._blocks.get(request_id, ())
            if b is not None and b.block_hash is not None
        ]
        if not self.kept.enabled or not blocks:
            return 0
        self.pool.touch(blocks)
        self._drop(self.kept.keep(conversation, blocks))
        return len(blocks)

    def mark_turn(self, request: Request, conversation: str) -> None:
        """`request` is a turn of `conversation`: kept when it finishes (`keep_turn`, by the
        scheduler); counts a follow-up arriving while the conversation's last turn is kept."""
        request.conversation = conversation
        self.kept.hit(conversation)

    def expire_kept(self) -> None:
        """Release the kept turns past their TTL (their blocks stay cached until evicted)."""
        self._drop(self.kept.expired())

    def _drop(self, blocks: list[Block]) -> None:
        self.pool.free_blocks(reversed(blocks))  # the turn's tail is evicted first

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
