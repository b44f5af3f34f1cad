"""engine.kv_cache_manager: block tables, prefix-cache lookups, allocation, freeing, stats."""

from __future__ import annotations

import pytest

from factories import assert_no_leaks, make_kv, make_request
from pdserve.engine.block_pool import hash_full_blocks
from pdserve.engine.kv_cache_manager import KVCacheManager, PrefixHit
from pdserve.engine.request import Request

BS = 4


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: look up, allocate, count progress."""
    prefix = kv.find_cached_prefix(req)
    remaining = req.num_tokens - prefix.num_tokens
    num_new = remaining if num_new is None else num_new
    ids = kv.allocate_slots(req, num_new, prefix)
    if ids is not None:
        req.num_computed_tokens += prefix.num_tokens + num_new
    return ids


def decode(kv: KVCacheManager, req: Request, token: int = 5) -> list[int] | None:
    """One decode step: the last sampled token gets its slot, then the next one is sampled."""
    ids = kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    if ids is not None:
        req.num_computed_tokens = req.num_tokens
        req.append_token(token)
    return ids


def lookup(kv: KVCacheManager, prompt: list[int]) -> int:
    """Cached tokens a new request with `prompt` would get (the lookup is then forgotten)."""
    req = make_request(prompt=prompt)
    num = kv.find_cached_prefix(req).num_tokens
    kv.free(req.request_id)  # a lookup remembers the request's hashes until it is freed
    return num


def snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.pool
    return (
        list(pool._free),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        dict(pool._cached),
        {rid: list(bs) for rid, bs in kv._blocks.items()},
        dict(kv._num_cached),
        pool.num_evictions,
    )


def test_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


def test_allocate_and_free_round_trip() -> None:
    kv = make_kv(num_blocks=8, block_size=BS)
    req = make_request(prompt_len=9)
    assert not kv.has_request(req.request_id)
    ids = admit(kv, req)
    assert ids is not None and len(ids) == 3
    assert kv.get_block_ids(req.request_id) == ids
    assert kv.has_request(req.request_id)
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(req.request_id)
    assert kv.get_block_ids(req.request_id) == []
    kv.free(req.request_id)  # freeing twice (or an unknown id) is a no-op
    kv.free("never-seen")
    assert_no_leaks(kv)


def test_blocks_needed() -> None:
    kv = make_kv(block_size=BS)
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert_no_leaks(kv)


def test_only_full_blocks_are_cached() -> None:
    kv = make_kv(num_blocks=8, block_size=BS)
    req = make_request(prompt_len=10)
    admit(kv, req)
    assert kv.pool.num_cached_blocks == 2  # tokens 0-7; the 2-token tail block is partial
    tail = kv._blocks[req.request_id][2]
    assert tail.block_hash is None
    expected = hash_full_blocks(req.prompt_token_ids, BS)
    assert [b.block_hash for b in kv._blocks[req.request_id][:2]] == expected
    kv.free(req.request_id)
    assert_no_leaks(kv)


def test_chunked_prefill_caches_blocks_as_they_fill() -> None:
    kv = make_kv(num_blocks=8, block_size=BS)
    req = make_request(prompt_len=12)
    assert admit(kv, req, num_new=5) is not None  # block 0 full, block 1 has one token
    assert kv.pool.num_cached_blocks == 1
    assert kv.allocate_slots(req, 2) is not None  # 7 tokens: block 1 still partial
    req.num_computed_tokens += 2
    assert kv.pool.num_cached_blocks == 1
    assert kv.allocate_slots(req, 5) is not None  # all 12
    req.num_computed_tokens += 5
    assert kv.pool.num_cached_blocks == 3
    assert len(kv.get_block_ids(req.request_id)) == 3
    kv.free(req.request_id)
    assert_no_leaks(kv)


def test_decode_caches_a_block_once_its_last_slot_is_written() -> None:
    kv = make_kv(num_blocks=8, block_size=BS)
    req = make_request(prompt_len=6)
    admit(kv, req)
    req.append_token(1)  # token 6 sampled
    assert kv.pool.num_cached_blocks == 1
    decode(kv, req)  # writes slot 6; block 1 (tokens 4-7) not full yet
    assert kv.pool.num_cached_blocks == 1 and len(kv.get_block_ids(req.request_id)) == 2
    decode(kv, req)  # writes slot 7: block 1 full
    assert kv.pool.num_cached_blocks == 2 and len(kv.get_block_ids(req.request_id)) == 2
    decode(kv, req)  # slot 8: a third block
    assert len(kv.get_block_ids(req.request_id)) == 3
    # The hashes cover prompt and generated tokens alike.
    blocks = kv._blocks[req.request_id]
    assert blocks[1].block_hash == hash_full_blocks(req.all_token_ids, BS)[1]
    kv.free(req.request_id)
    assert_no_leaks(kv)


def test_prefix_hit_shares_blocks_and_leaves_a_token_to_compute() -> None:
    kv = make_kv(num_blocks=16, block_size=BS)
    prompt = list(range(100, 112))  # 3 full blocks
    a = make_request(prompt=prompt)
    admit(kv, a)
    a_ids = kv.get_block_ids(a.request_id)

    # The same prompt: only 2 of 3 blocks may hit, the last block must run for its logits.
    b = make_request(prompt=prompt)
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 8 and [x.block_id for x in hit.blocks] == a_ids[:2]
    ids = kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit)
    assert ids is not None and ids[:2] == a_ids[:2] and ids[2] != a_ids[2]
    assert [kv.pool.blocks[i].ref_cnt for i in a_ids] == [2, 2, 1]

    # A longer prompt with the same start hits all three blocks.
    c = make_request(prompt=[*prompt, 1, 2])
    hit = kv.find_cached_prefix(c)
    assert hit.num_tokens == 12 and [x.block_id for x in hit.blocks] == a_ids

    # A prompt diverging inside block 1 hits block 0 only.
    d = make_request(prompt=[*prompt[:6], 0, 0, *prompt[8:]])
    assert kv.find_cached_prefix(d).num_tokens == 4

    # One token beyond a block boundary still counts: 12 + 1 tokens hits 12.
    e = make_request(prompt=[*prompt, 9])
    assert kv.find_cached_prefix(e).num_tokens == 12

    for r in (a, b, c, d, e):
        kv.free(r.request_id)
    assert_no_leaks(kv)


@pytest.mark.parametrize("length", [1, 3, 4, 5, 8, 9])
def test_prefix_hit_never_covers_the_whole_request(length: int) -> None:
    kv = make_kv(num_blocks=16, block_size=BS)
    prompt = list(range(1, length + 1))
    admit(kv, make_request("a", prompt=prompt))
    hit = kv.find_cached_prefix(make_request("b", prompt=prompt))
    assert hit.num_tokens <= length - 1
    assert hit.num_tokens == (length - 1) // BS * BS
    kv.free("a")
    kv.free("b")
    assert_no_leaks(kv)


def test_hit_on_freed_blocks_revives_them() -> None:
    kv = make_kv(num_blocks=4, block_size=BS)
    prompt = list(range(9))
    a = make_request(prompt=prompt)
    admit(kv, a)
    a_ids = kv.get_block_ids(a.request_id)
    kv.free(a.request_id)
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 2
    b = make_request(prompt=prompt)
    ids = admit(kv, b)
    assert ids is not None and ids[:2] == a_ids[:2]
    assert b.num_computed_tokens == 9
    assert kv.num_free_blocks == 1
    kv.free(b.request_id)
    assert_no_leaks(kv)


def test_free_releases_tail_blocks_first() -> None:
    kv = make_kv(num_blocks=4, block_size=BS)
    req = make_request(prompt=list(range(16)))
    ids = admit(kv, req)
    assert ids is not None
    kv.free(req.request_id)
    assert list(kv.pool._free) == ids[::-1]  # the prefix's first block is evicted last
    # Evicting one block for a newcomer keeps the rest of the prefix findable.
    other = make_request(prompt_len=3)
    admit(kv, other)
    assert lookup(kv, list(range(16))) == 12
    kv.free(other.request_id)
    assert_no_leaks(kv)


def test_lru_eviction_prefers_least_recently_freed_prefix() -> None:
    kv = make_kv(num_blocks=4, block_size=BS)
    old, new = [1] * 5, [2] * 5
    for prompt in (old, new):
        r = make_request(prompt=prompt)
        admit(kv, r)
        kv.free(r.request_id)
    assert kv.pool.num_cached_blocks == 2
    # A newcomer needing 3 blocks evicts 2 unhashed tail blocks and the older prefix's block.
    third = make_request(prompt_len=12)
    admit(kv, third)
    assert lookup(kv, old) == 0
    assert lookup(kv, new) == 4
    kv.free(third.request_id)
    assert_no_leaks(kv)


def test_allocate_returns_none_and_changes_nothing_when_short() -> None:
    kv = make_kv(num_blocks=4, block_size=BS)
    a = make_request(prompt_len=8)
    admit(kv, a)
    b = make_request(prompt_len=9)  # needs 3, 2 free
    before = snapshot(kv)
    assert kv.allocate_slots(b, 9) is None
    assert snapshot(kv) == before
    assert not kv.has_request(b.request_id)
    # A running request that cannot grow is refused without changes too.
    a.append_token(1)
    assert kv.allocate_slots(a, 9) is None
    assert snapshot(kv) == before
    kv.free(a.request_id)
    kv.free(b.request_id)
    assert_no_leaks(kv)


def test_allocate_counts_free_hit_blocks_as_not_free() -> None:
    """Hit blocks in the free queue are free now, but stop being free once touched."""
    kv = make_kv(num_blocks=4, block_size=BS)
    prompt = list(range(12))
    a = make_request(prompt=[*prompt, 0])
    admit(kv, a)  # 4 blocks, 3 cached
    kv.free(a.request_id)
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 3

    # 12 prompt tokens hit + 8 new = 5 blocks: 3 hits (all free) + 2 new; only 1 other block.
    b = make_request(prompt=[*prompt, *range(50, 58)])
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 12 and all(x.ref_cnt == 0 for x in hit.blocks)
    before = snapshot(kv)
    assert kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit) is None
    assert snapshot(kv) == before
    assert all(x.ref_cnt == 0 for x in hit.blocks)

    # 12 hit + 4 new = 4 blocks: exactly fits.
    c = make_request(prompt=[*prompt, *range(60, 64)])
    hit = kv.find_cached_prefix(c)
    ids = kv.allocate_slots(c, c.num_tokens - hit.num_tokens, hit)
    assert ids is not None and len(ids) == 4 and kv.num_free_blocks == 0
    for r in (b, c):
        kv.free(r.request_id)
    assert_no_leaks(kv)


def test_allocate_with_hit_blocks_held_by_another_request() -> None:
    kv = make_kv(num_blocks=4, block_size=BS)
    prompt = list(range(8))
    a = make_request(prompt=[*prompt, 99])
    admit(kv, a)  # 3 blocks, 2 cached and in use
    b = make_request(prompt=[*prompt, 98])
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 8
    ids = kv.allocate_slots(b, 1, hit)  # 2 shared + 1 new: fits in the 1 free block
    assert ids is not None and kv.num_free_blocks == 0
    kv.free(a.request_id)
    assert kv.num_free_blocks == 1  # the shared prefix is still held by b
    kv.free(b.request_id)
    assert_no_leaks(kv)


def test_prefix_cache_stats() -> None:
    kv = make_kv(num_blocks=16, block_size=BS)
    assert kv.stats.hit_rate == 0.0
    prompt = list(range(16))
    admit(kv, make_request("a", prompt=prompt))
    assert (kv.stats.queries, kv.stats.hits) == (16, 0)
    admit(kv, make_request("b", prompt=prompt))  # 12 of 16 hit
    assert (kv.stats.queries, kv.stats.hits) == (32, 12)
    assert kv.stats.hit_rate == pytest.approx(12 / 32)
    kv.free("a")
    kv.free("b")
    assert_no_leaks(kv)


def test_caching_disabled() -> None:
    kv = make_kv(num_blocks=8, block_size=BS, caching=False)
    prompt = list(range(12))
    admit(kv, make_request("a", prompt=prompt))
    assert kv.pool.num_cached_blocks == 0
    b = make_request("b", prompt=prompt)
    assert kv.find_cached_prefix(b) == PrefixHit([], 0)
    assert kv.stats.queries == 0
    admit(kv, b)
    assert set(kv.get_block_ids("a")).isdisjoint(kv.get_block_ids("b"))
    kv.free("a")
    kv.free("b")
    assert_no_leaks(kv)


def test_root_hash_separates_caches() -> None:
    prompt = list(range(8))
    one = KVCacheManager(8, BS, root_hash=b"model-a")
    two = KVCacheManager(8, BS, root_hash=b"model-b")
    for kv in (one, two):
        admit(kv, make_request("a", prompt=prompt))
    assert set(one.pool._cached).isdisjoint(two.pool._cached)
    assert list(one.pool._cached) == hash_full_blocks(prompt, BS, b"model-a")
    for kv in (one, two):
        kv.free("a")
        assert_no_leaks(kv)


def test_reset_prefix_cache() -> None:
    kv = make_kv(num_blocks=8, block_size=BS)
    prompt = list(range(12))
    admit(kv, make_request("a", prompt=prompt))
    kv.free("a")
    assert kv.reset_prefix_cache() == 3
    assert kv.find_cached_prefix(make_request("b", prompt=prompt)).num_tokens == 0
    kv.free("b")
    assert_no_leaks(kv)


def test_duplicate_content_computed_twice_is_cached_once() -> None:
    kv = make_kv(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    a, b = make_request("a", prompt=prompt), make_request("b", prompt=prompt)
    # Both looked up before either allocated: neither hits, both compute the same blocks.
    hit_a, hit_b = kv.find_cached_prefix(a), kv.find_cached_prefix(b)
    kv.allocate_slots(a, 9, hit_a)
    kv.allocate_slots(b, 9, hit_b)
    assert kv.pool.num_cached_blocks == 2
    assert [x.block_hash for x in kv._blocks["b"][:2]] == [None, None]
    kv.free("a")
    kv.free("b")
    assert kv.find_cached_prefix(make_request("c", prompt=prompt)).num_tokens == 8
    kv.free("c")
    assert_no_leaks(kv)
