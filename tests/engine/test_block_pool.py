"""engine.block_pool: chained block hashes, reference counts, LRU free queue, prefix-cache map."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from factories import assert_no_leaks
from pdserve.engine.block_pool import (
    ROOT_HASH,
    BlockPool,
    hash_block_tokens,
    hash_full_blocks,
)

TOKENS = [11, 22, 33, 44, 55, 66, 77, 88, 99, 1000]


def _hash_in_subprocess(seed: str) -> str:
    code = (
        "from pdserve.engine.block_pool import hash_full_blocks\n"
        f"print(','.join(h.hex() for h in hash_full_blocks({TOKENS!r}, 4)))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed}
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return res.stdout.strip()


# ---- hashing ---------------------------------------------------------------------------------
def test_hash_is_deterministic_across_processes() -> None:
    here = ",".join(h.hex() for h in hash_full_blocks(TOKENS, 4))
    assert _hash_in_subprocess("1") == here
    assert _hash_in_subprocess("12345") == here


def test_hash_is_sha256_sized_and_repeatable() -> None:
    h = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 32
    assert h == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert h == hash_block_tokens(ROOT_HASH, (1, 2, 3, 4))  # any sequence type
    assert h != hash_block_tokens(ROOT_HASH, [1, 2, 4, 3])
    assert h != hash_block_tokens(b"other-root", [1, 2, 3, 4])


def test_hash_is_chained() -> None:
    # The same block content behind different parents hashes differently.
    a = hash_full_blocks([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = hash_full_blocks([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]
    assert a[1] == hash_block_tokens(a[0], [9, 9, 9, 9])
    assert a[0] == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])


def test_hash_full_blocks_ignores_partial_tail() -> None:
    assert len(hash_full_blocks(TOKENS, 4)) == 2
    assert len(hash_full_blocks(TOKENS[:8], 4)) == 2
    assert len(hash_full_blocks(TOKENS[:7], 4)) == 1
    assert hash_full_blocks(TOKENS[:3], 4) == []
    assert hash_full_blocks([], 4) == []
    # A longer sequence extends, never changes, the hashes of its prefix.
    assert hash_full_blocks(TOKENS, 4)[:1] == hash_full_blocks(TOKENS[:4], 4)


def test_hash_distinguishes_large_and_negative_token_ids() -> None:
    assert hash_block_tokens(ROOT_HASH, [2**40]) != hash_block_tokens(ROOT_HASH, [0])
    assert hash_block_tokens(ROOT_HASH, [-1]) != hash_block_tokens(ROOT_HASH, [1])
    # Not a string concatenation: [1, 23] and [12, 3] differ.
    assert hash_block_tokens(ROOT_HASH, [1, 23]) != hash_block_tokens(ROOT_HASH, [12, 3])


# ---- pool ------------------------------------------------------------------------------------
def test_rejects_non_positive_size() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_allocation_and_free_round_trip() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1  # a refused request takes nothing
    pool.free_blocks(blocks)
    assert_no_leaks(pool)


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([block])
    assert_no_leaks(pool)


def test_shared_block_is_freed_after_last_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2
    assert_no_leaks(pool)


def test_free_queue_is_lru_in_free_order() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    # Freed in the order 2, 0, 3, 1: reused in that same order.
    pool.free_blocks([blocks[2], blocks[0]])
    pool.free_blocks([blocks[3], blocks[1]])
    again = pool.get_new_blocks(4)
    assert [b.block_id for b in again] == [2, 0, 3, 1]
    pool.free_blocks(again)
    assert_no_leaks(pool)


def test_cached_block_stays_findable_after_free_until_evicted() -> None:
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    ha, hb, hc = (hash_block_tokens(ROOT_HASH, [i]) for i in range(3))
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    pool.cache_block(c, hc)
    # Least recently freed first: b, then a, then c.
    pool.free_blocks([b])
    pool.free_blocks([a])
    pool.free_blocks([c])
    assert pool.num_cached_blocks == 3
    assert pool.get_cached_block(ha) is a  # free, but its content is still valid

    (first,) = pool.get_new_blocks(1)
    assert first is b
    assert b.block_hash is None and pool.get_cached_block(hb) is None  # eviction drops the hash
    assert pool.get_cached_block(ha) is a and pool.get_cached_block(hc) is c
    assert pool.num_evictions == 1

    (second,) = pool.get_new_blocks(1)
    assert second is a and pool.get_cached_block(ha) is None
    assert pool.num_evictions == 2 and pool.num_cached_blocks == 1
    pool.free_blocks([first, second])
    pool.reset_prefix_cache()
    assert_no_leaks(pool)


def test_touch_of_free_cached_block_removes_it_from_free_queue() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    h = hash_block_tokens(ROOT_HASH, [42])
    pool.cache_block(blocks[0], h)
    pool.free_blocks(blocks)
    hit = pool.get_cached_block(h)
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 2
    assert hit.block_id not in pool._free
    # Neither of the two remaining free blocks is the touched one, and it keeps its hash.
    others = pool.get_new_blocks(2)
    assert hit not in others
    assert pool.get_cached_block(h) is hit
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    # Freed again, it goes to the back of the queue (most recently freed).
    pool.free_blocks(others)
    pool.free_blocks([hit])
    assert list(pool._free)[-1] == hit.block_id
    assert_no_leaks(pool)


def test_touch_of_used_cached_block_only_adds_a_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"h" * 32)
    pool.touch([block])
    assert block.ref_cnt == 2 and pool.num_free_blocks == 1
    pool.free_blocks([block, block])
    assert_no_leaks(pool)


def test_first_block_with_a_hash_wins() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(ROOT_HASH, [1])
    pool.cache_block(a, h)
    pool.cache_block(b, h)  # same content computed twice: the map keeps the first
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.cache_block(a, hash_block_tokens(ROOT_HASH, [2]))  # a block is hashed once
    assert a.block_hash == h
    pool.free_blocks([a, b])
    assert_no_leaks(pool)


def test_evicting_a_block_keeps_others_hashes() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"a" * 32)
    pool.free_blocks([b, a])  # b (uncached) is evicted, i.e. reused, first
    (reused,) = pool.get_new_blocks(1)
    assert reused is b
    assert pool.get_cached_block(b"a" * 32) is a and pool.num_evictions == 0
    pool.free_blocks([reused])
    assert_no_leaks(pool)


def test_caching_disabled_never_finds_anything() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"x" * 32)
    assert block.block_hash is None
    assert pool.get_cached_block(b"x" * 32) is None
    pool.free_blocks([block])
    assert_no_leaks(pool)


def test_reset_prefix_cache_drops_only_free_blocks() -> None:
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    for i, block in enumerate((a, b, c)):
        pool.cache_block(block, bytes([i]) * 32)
    pool.free_blocks([a, b])
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_blocks == 1 and pool.get_cached_block(bytes([2]) * 32) is c
    assert pool.num_free_blocks == 2
    pool.free_blocks([c])
    assert pool.reset_prefix_cache() == 1
    assert pool.num_cached_blocks == 0
    assert_no_leaks(pool)
