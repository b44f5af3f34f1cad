"""Two KV groups (engine/hybrid_kv.py): the global layers' blocks and the sliding layers' (window
8, blocks of 4). The sliding group holds only the window's blocks as a request grows, the global
group all of them; allocation takes both groups' blocks or neither's; a prefix hit needs the
global blocks of the whole hit and the sliding ones of the window before its end; fork, trim,
reserve and kept turns act on both; every block is back in its pool after free."""

from __future__ import annotations

import pytest

from factories import assert_no_leaks, make_hybrid_kv, make_request
from pdserve.engine.block_pool import hash_full_blocks
from pdserve.engine.hybrid_kv import HybridKVCacheManager, split_blocks

BS, WINDOW = 4, 8


def _real(ids: list[int] | None, null: int) -> int:
    return sum(b != null for b in ids or ())


def test_split_blocks_gives_the_sliding_group_its_steady_state() -> None:
    # 2 sequences x (cdiv(47, 8) + 2) + cdiv(32, 8) = 20 blocks, a quarter more: 25
    size = split_blocks(100, 4, 2, 48, 8, max_num_seqs=2, max_num_batched_tokens=32)
    assert (size.steady, size.sliding) == (20, 25)
    assert size.full == (100 * 4 - 25 * 2) // 2 == 175  # the bytes the sliding layers left
    # a steady state past the shared layout's share: the shared layout's blocks, both groups
    size = split_blocks(100, 4, 2, 48, 8, max_num_seqs=256, max_num_batched_tokens=2048)
    assert (size.full, size.sliding) == (100, 100)


def test_the_sliding_group_frees_blocks_as_the_window_moves() -> None:
    kv = make_hybrid_kv(num_blocks=64, sliding_blocks=8)
    null = kv.sliding.null_block
    assert null is not None
    req = make_request("r", 40)
    for start in range(0, 40, 4):  # a prompt in chunks of 4
        assert kv.allocate_slots(req, 4) is not None
        req.num_computed_tokens = start + 4
        held = _real(kv.sliding_block_ids("r"), null.block_id)
        assert held <= -(-(WINDOW - 1 + 4) // BS) + 1  # the window and one chunk: 4
        assert len(kv.get_block_ids("r")) == start // BS + 1  # the global group keeps all
    assert kv.sliding.num_blocks - kv.sliding.num_free_blocks == 3
    assert kv.full.num_blocks - kv.full.num_free_blocks == 10
    kv.free("r")
    assert_no_leaks(kv)


def test_allocation_takes_both_groups_or_neither() -> None:
    kv = make_hybrid_kv(num_blocks=64, sliding_blocks=4)  # 3 usable sliding blocks
    a = make_request("a", 8)
    assert kv.allocate_slots(a, 8) is not None  # 2 of each
    b = make_request("b", 8)
    free = (kv.full.num_free_blocks, kv.sliding.num_free_blocks)
    assert kv.allocate_slots(b, 8) is None  # the sliding group is short
    assert (kv.full.num_free_blocks, kv.sliding.num_free_blocks) == free
    assert not kv.has_request("b") and kv.sliding_block_ids("b") == []
    assert kv.reserve("b", 8) is None and not kv.has_request("b")
    assert kv.reserve_with_prefix(b, 8, 7) is None
    assert (kv.full.num_free_blocks, kv.sliding.num_free_blocks) == free
    kv.free("a")
    kv.free("b")
    assert_no_leaks(kv)
    # and the global group short, the sliding one not
    kv = make_hybrid_kv(num_blocks=2, sliding_blocks=16)
    assert kv.allocate_slots(make_request("c", 12), 12) is None
    assert kv.sliding.num_free_blocks == kv.sliding.num_blocks
    assert_no_leaks(kv)


def test_a_prefix_hit_needs_both_groups() -> None:
    kv = make_hybrid_kv(num_blocks=64, sliding_blocks=16)
    first = make_request("a", 33)
    assert kv.allocate_slots(first, 33) is not None
    first.num_computed_tokens = 33
    kv.free("a")
    again = make_request("b", 33, prompt=first.prompt_token_ids)
    hit = kv.find_cached_prefix(again)
    assert hit.num_tokens == 32  # 8 full blocks: the global ones all, the window's 2 sliding
    assert kv.allocate_slots(again, 1, hit) is not None
    null = kv.sliding.null_block
    assert null is not None
    assert _real(kv.sliding_block_ids("b"), null.block_id) == 3  # blocks 6, 7 and the new one
    kv.free("b")
    # the window's blocks evicted from the sliding group: the hit ends before them
    sliding = kv.sliding.pool
    for h in hash_full_blocks(first.prompt_token_ids, BS)[6:8]:
        sliding._evict(sliding._cached[h])
    third = make_request("c", 33, prompt=first.prompt_token_ids)
    assert kv.find_cached_prefix(third).num_tokens == 24  # blocks 4, 5 cover the window of 24
    assert kv.peek_cached_prefix_tokens(third) == 24
    # only the global group's hashes are reported (what a hit needs everywhere)
    assert len(kv.cached_hashes()) == 8 and kv.take_events()[0]
    kv.free("c")
    assert_no_leaks(kv)


def test_fork_copies_the_partial_block_in_each_group_and_trim_frees_both() -> None:
    kv = make_hybrid_kv(num_blocks=16, sliding_blocks=8)
    p = make_request("p", 10)
    assert kv.allocate_slots(p, 10) is not None
    p.num_computed_tokens = 10
    copies = kv.fork_copies("p", "c", 10)
    assert [g for g, _, _ in copies] == [0, 1]
    assert copies[0][1] == kv.get_block_ids("p")[2] and copies[0][2] == kv.get_block_ids("c")[2]
    assert copies[1][1] == kv.sliding_block_ids("p")[2]  # type: ignore[index]
    kv.free("p")
    kv.free("c")
    # a speculative step's rejected drafts: both groups give back the blocks past the kept
    q = make_request("q", 5)
    assert kv.allocate_slots(q, 11) is not None  # 5 tokens and 6 drafts: 3 blocks
    kv.trim("q", 6)
    assert len(kv.get_block_ids("q")) == 2 and len(kv.sliding_block_ids("q") or ()) == 2
    kv.free("q")
    assert_no_leaks(kv)


def test_fork_without_a_block_in_either_group_changes_nothing() -> None:
    kv = make_hybrid_kv(num_blocks=16, sliding_blocks=4)  # 3 usable sliding blocks
    p = make_request("p", 10)
    assert kv.allocate_slots(p, 10) is not None
    with pytest.raises(MemoryError):
        kv.fork_copies("p", "c", 10)
    assert not kv.has_request("c") and not kv.sliding.has_request("c")
    kv.free("p")
    assert_no_leaks(kv)


def test_reserve_registers_sliding_blocks_only_from_where_their_kv_arrives() -> None:
    kv = make_hybrid_kv(num_blocks=16, sliding_blocks=8)
    req = make_request("d", 20)
    got = kv.reserve_with_prefix(req, 20, 19, complete_from=20 - WINDOW)
    assert got is not None and got[1] == 0
    null = kv.sliding.null_block
    assert null is not None
    assert _real(kv.sliding_block_ids("d"), null.block_id) == 2  # token 19's window: 12-19
    req.num_computed_tokens = 19
    assert kv.allocate_slots(req, 1) is not None
    assert kv.full.num_cached_blocks == 5  # every global block arrived whole
    assert kv.sliding.num_cached_blocks == 2  # blocks 3 and 4: from token 12 on
    kv.free("d")
    assert_no_leaks(kv)


def _kept_turn(kv: HybridKVCacheManager) -> int:
    """Request "t" computes 16 tokens in steps of 4 and ends as conversation "conv"'s kept
    turn (a 60 s TTL in both groups); the global blocks kept."""
    for g in kv.groups:
        g.kept.ttl_s = 60.0
    req = make_request("t", 16)
    kv.mark_turn(req, "conv")
    for start in range(0, 16, 4):
        assert kv.allocate_slots(req, 4) is not None
        req.num_computed_tokens = start + 4
    kept = kv.keep_turn("t", "conv")
    kv.free("t")
    return kept


def test_kept_turns_and_the_reset_act_on_both_groups() -> None:
    kv = make_hybrid_kv(num_blocks=16, sliding_blocks=8)
    assert _kept_turn(kv) == 4
    # the sliding group kept what the last step's window held: blocks 1-3 (from token 5)
    assert kv.full.num_kept_blocks == 4 and kv.sliding.num_kept_blocks == 3
    assert kv.num_kept_blocks == 7 and len(kv.kept) == 1
    assert kv.reset_prefix_cache() == 4  # the kept turns go first, then every cached hash
    assert kv.num_kept_blocks == 0 and kv.sliding.num_cached_blocks == 0
    assert_no_leaks(kv)


def test_memory_pressure_releases_a_kept_turn_in_both_groups() -> None:
    """The sliding group short: the oldest kept conversation goes from both groups at once
    (its global blocks alone would make no hit)."""
    kv = make_hybrid_kv(num_blocks=64, sliding_blocks=5)  # 4 usable sliding blocks
    _kept_turn(kv)
    assert (kv.full.num_kept_blocks, kv.sliding.num_kept_blocks) == (4, 3)
    other = make_request("o", 12)
    assert kv.allocate_slots(other, 12) is not None  # 3 sliding blocks: the turn must go
    assert len(kv.full.kept) == len(kv.sliding.kept) == 0
    assert kv.kept.stats.released["pressure"] == 1
    kv.free("o")
    assert_no_leaks(kv)
