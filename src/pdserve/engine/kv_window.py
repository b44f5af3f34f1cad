"""What a KV manager needs to know about sliding windows and prefix hits, apart from its state.

A layer with a sliding window of W reads, for the query at position p, only the keys of
[p - W + 1, p]. Blocks wholly before that run can go back to the pool (`out_of_window`), so a
request holds at most the window's blocks and one step's (`peak_blocks`), and a prefix hit needs
only the blocks its first uncomputed token sees (`window_lookup`). Pure functions of the window,
the block size and a `BlockPool`: `KVCacheManager` (engine/kv_cache_manager.py) keeps the state.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.block_pool import Block, BlockHash, BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixHit:
    """Result of a prefix-cache lookup: opaque to callers except for the token count. Under a
    window, leading entries the hit does not need are None."""

    blocks: list[Block | None]
    num_tokens: int


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def out_of_window(window: int | None, block_size: int, position: int) -> int:
    """Leading blocks nothing computed from `position` on reads: those wholly before the first
    key `position` sees (0 without a window)."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size


def peak_blocks(window: int | None, block_size: int, num_tokens: int, chunk: int) -> int:
    """The most blocks a request holds at once while its KV grows to `num_tokens` tokens,
    `chunk` at most per step: all of them, or under a window those its window and one chunk
    span (a step at p computing n tokens holds the blocks of [p - window + 1, p + n),
    cdiv(window - 1 + n, block_size) + 1 at most for a window starting mid-block)."""
    full = cdiv(num_tokens, block_size)
    if window is None:
        return full
    span = window - 1 + max(1, min(chunk, num_tokens))
    return min(full, cdiv(span, block_size) + 1)


def window_lookup(
    pool: BlockPool, hashes: list[BlockHash], window: int, block_size: int
) -> PrefixHit:
    """The longest hit of h blocks whose last cdiv(window - 1, block_size) blocks (what the
    query at h * block_size sees before itself) are cached, or whose blocks are all cached from
    the first; found from the right, as vLLM's SlidingWindowManager does. Entries before those
    are None."""
    need = cdiv(window - 1, block_size)
    run: list[Block] = []  # cached blocks, right to left, ending just before the hit's end
    for i in range(len(hashes) - 1, -1, -1):
        block = pool.get_cached_block(hashes[i])
        if block is None:
            run = []
            continue
        run.append(block)
        if len(run) >= need:
            hit: list[Block | None] = [None] * i
            hit.extend(reversed(run))
            return PrefixHit(hit, len(hit) * block_size)
    run.reverse()  # a run from block 0 shorter than the window: every key it needs
    return PrefixHit(list(run), len(run) * block_size)
