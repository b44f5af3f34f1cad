"""Prefix-cache events (stored / removed block hashes, bounded, snapshot on overflow) and
`reserve_with_prefix` / `LLMEngine.reserve_kv`: a decode worker reuses its cached prefix."""

from __future__ import annotations

import pytest
import torch

from factories import (
    assert_engine_idle,
    assert_no_leaks,
    make_kv,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)
from pdserve import LLM, SamplingParams
from pdserve.engine.block_pool import BlockPool, hash_block_tokens, hash_full_blocks
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request

BS = 4


def admit(kv: KVCacheManager, req: Request) -> None:
    """Compute a whole request's prompt (what the scheduler does for a waiting request)."""
    prefix = kv.find_cached_prefix(req)
    assert kv.allocate_slots(req, req.num_tokens - prefix.num_tokens, prefix) is not None
    req.num_computed_tokens = req.num_tokens


# ---- events ----------------------------------------------------------------------------------
def test_hash_full_blocks_equals_chaining_block_hashes() -> None:
    tokens = list(range(-3, 40))
    parent, want = b"root", []
    for start in range(0, len(tokens) - BS + 1, BS):
        parent = hash_block_tokens(parent, tokens[start : start + BS])
        want.append(parent)
    assert hash_full_blocks(tokens, BS, b"root") == want
    assert hash_full_blocks(tokens[:3], BS) == []


def test_stored_events_name_the_registered_blocks_and_drain_once() -> None:
    kv = make_kv(num_blocks=16, block_size=BS)
    assert not kv.has_events and kv.take_events() == ([], [], False)
    prompt = list(range(10))
    admit(kv, make_request("a", prompt=prompt))
    assert kv.has_events
    stored, removed, cleared = kv.take_events()
    assert stored == hash_full_blocks(prompt, BS) and removed == [] and not cleared
    assert all(isinstance(h, bytes) and len(h) == 32 for h in stored)
    assert not kv.has_events and kv.take_events() == ([], [], False)
    assert kv.cached_hashes() == stored
    kv.free("a")  # freed blocks keep their hashes: nothing changes in the map
    assert not kv.has_events
    assert_no_leaks(kv)


def test_eviction_on_reuse_and_reset_report_removed() -> None:
    kv = make_kv(num_blocks=4, block_size=BS)
    first = list(range(8))
    admit(kv, make_request("a", prompt=first))
    kv.free("a")
    kv.take_events()
    admit(kv, make_request("b", prompt=list(range(100, 116))))  # needs all 4 blocks
    stored, removed, _ = kv.take_events()
    assert set(removed) == set(hash_full_blocks(first, BS))
    assert len(stored) == 4 and not set(stored) & set(removed)
    kv.free("b")
    assert kv.reset_prefix_cache() == 4
    stored, removed, cleared = kv.take_events()
    assert stored == [] and sorted(removed) == sorted(hash_full_blocks(range(100, 116), BS))
    assert not cleared and kv.cached_hashes() == []
    assert_no_leaks(kv)


def test_only_the_net_change_since_the_last_drain_is_reported() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h1")
    pool.free_blocks([a])
    (c,) = pool.get_new_blocks(1)  # evicts h1 again before anyone drained
    assert c is a
    assert pool.take_events() == ([], [b"h1"], False)  # removing an unseen hash is harmless
    pool.cache_block(b, b"h2")
    pool.take_events()
    pool.free_blocks([b])
    pool.reset_prefix_cache()
    pool.cache_block(c, b"h2")  # removed, then stored again: stored
    assert pool.take_events() == ([b"h2"], [], False)


def test_overflowing_buffer_is_dropped_for_a_full_snapshot() -> None:
    pool = BlockPool(8, max_pending_events=3)
    blocks = pool.get_new_blocks(8)
    for i, block in enumerate(blocks[:4]):
        pool.cache_block(block, bytes([i]) * 32)
    assert pool.has_events and not pool._events  # dropped, not grown past the bound
    stored, removed, cleared = pool.take_events()
    assert cleared and removed == [] and sorted(stored) == sorted(pool.cached_hashes())
    assert len(stored) == 4
    pool.cache_block(blocks[4], b"x" * 32)  # back to deltas after the snapshot
    assert pool.take_events() == ([b"x" * 32], [], False)


def test_no_events_without_prefix_caching() -> None:
    kv = make_kv(num_blocks=8, block_size=BS, caching=False)
    admit(kv, make_request("a", prompt=list(range(12))))
    assert not kv.has_events and kv.cached_hashes() == []
    kv.free("a")
    assert_no_leaks(kv)


# ---- reserve with a cached prefix ------------------------------------------------------------
def test_reserve_with_prefix_reuses_cached_blocks() -> None:
    kv = make_kv(num_blocks=16, block_size=BS)
    shared = list(range(12))
    admit(kv, make_request("a", prompt=[*shared, 50, 51]))
    hit_ids = kv.get_block_ids("a")[:3]
    kv.free("a")  # the prefix stays cached in free blocks
    before = (kv.stats.queries, kv.stats.hits)
    req = make_request("d", prompt=[*shared, 60, 61, 62])
    got = kv.reserve_with_prefix(req, 16, max_cached_tokens=14)
    assert got is not None
    block_ids, cached = got
    assert cached == 12 and block_ids[:3] == hit_ids and len(block_ids) == 4
    assert kv._num_cached["d"] == 3  # already registered: never registered again
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in block_ids)  # touched: not evictable
    assert (kv.stats.queries - before[0], kv.stats.hits - before[1]) == (15, 12)
    kv.take_events()
    other = make_request("x", prompt_len=48)
    assert kv.allocate_slots(other, 48) is not None  # takes every other block
    assert kv.take_events()[1] == []  # none of the reserved hit blocks was evicted
    kv.free("x")
    kv.free("d")
    assert_no_leaks(kv)


@pytest.mark.parametrize(("max_cached", "want"), [(11, 8), (4, 4), (3, 0), (0, 0)])
def test_reserve_with_prefix_caps_the_hit(max_cached: int, want: int) -> None:
    kv = make_kv(num_blocks=16, block_size=BS)
    prompt = list(range(16))
    admit(kv, make_request("a", prompt=prompt))
    kv.free("a")
    got = kv.reserve_with_prefix(make_request("d", prompt=prompt), 17, max_cached)
    assert got is not None and got[1] == want
    kv.free("d")
    assert_no_leaks(kv)


def test_reserve_with_prefix_leaves_a_prompt_token_to_receive() -> None:
    kv = make_kv(num_blocks=16, block_size=BS)
    prompt = list(range(8))  # two full blocks: only the first may be reused
    admit(kv, make_request("a", prompt=prompt))
    kv.free("a")
    got = kv.reserve_with_prefix(make_request("d", prompt=prompt), 9, 100)
    assert got is not None and got[1] == 4
    kv.free("d")
    assert_no_leaks(kv)


def test_reserve_with_prefix_short_of_memory_changes_nothing() -> None:
    kv = make_kv(num_blocks=4, block_size=BS)
    shared = list(range(8))
    admit(kv, make_request("a", prompt=shared))
    kv.free("a")
    # 2 hit blocks (free, so they stop counting as free) + 3 new > 4 blocks
    req = make_request("d", prompt=[*shared, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    stats = (kv.stats.queries, kv.stats.hits)
    assert kv.reserve_with_prefix(req, 20, 16) is None
    assert (kv.stats.queries, kv.stats.hits) == stats  # a retried reservation is not counted
    assert_no_leaks(kv)  # no blocks, no remembered hashes for "d"
    assert kv.reserve("d", 4) is not None
    with pytest.raises(ValueError, match="already holds"):
        kv.reserve_with_prefix(make_request("d", prompt=shared), 4, 0)
    kv.free("d")
    assert_no_leaks(kv)


def test_received_blocks_are_cached_after_admission_and_hits_are_not_reregistered() -> None:
    s = make_scheduler(num_blocks=16, block_size=BS)
    prompt = list(range(9))
    first = make_request("d1", prompt=prompt, max_tokens=2)
    assert s.kv.reserve_with_prefix(first, 10, 8) == (s.kv.get_block_ids("d1"), 0)
    assert s.kv.pool.num_cached_blocks == 0  # the KV has not arrived yet
    first.num_computed_tokens = 9
    first.output_token_ids.append(5)
    s.add_prefilled(first)
    step(s, check=False)
    assert s.kv.cached_hashes()[:2] == hash_full_blocks(prompt, BS)  # registered on admission
    run_to_completion(s, check=False)
    s.kv.take_events()
    second = make_request("d2", prompt=prompt, max_tokens=2)
    got = s.kv.reserve_with_prefix(second, 10, 8)
    assert got is not None and got[1] == 8
    second.num_computed_tokens = 9
    second.output_token_ids.append(5)
    s.add_prefilled(second)
    run_to_completion(s, check=False)
    assert s.kv.take_events() == ([], [], False)  # the hit blocks were not registered again
    assert_no_leaks(s)


# ---- the engine: reserve_kv on a real model --------------------------------------------------
def _prefill(p: LLM, prompt: list[int], rid: str) -> tuple[list[int], int]:
    pe = p.engine
    pe.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), rid, hold_kv=True)
    while pe.has_unfinished_requests():
        pe.step()
    held = pe.held_request(rid)
    assert held is not None
    return list(held.output_token_ids), held.num_computed_tokens


def _handoff_skipping_cached(p: LLM, d: LLM, prompt: list[int], rid: str) -> tuple[list[int], int]:
    """P computes, D reserves (reusing its cached prefix), only the rest is copied."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first, n_kv = _prefill(p, prompt, rid)
    blocks = d.engine.reserve_kv(prompt, params, rid, n_kv)
    assert blocks is not None
    have = blocks.cached_tokens
    src = p.engine.kv_slots(p.engine.kv_manager.get_block_ids(rid), have, n_kv)
    dst = d.engine.kv_slots(blocks, have, n_kv)
    for layer in range(p.engine.arch.num_layers):
        d.engine.write_kv(dst, layer, *p.engine.read_kv(src, layer))
    assert p.engine.release_kv(rid)
    d.engine.admit_prefilled(rid, first, n_kv)
    out = None
    while d.engine.has_unfinished_requests():
        for o in d.engine.step():
            out = o
    assert out is not None and out.finished
    return out.outputs[0].token_ids, have


def test_reserve_kv_reuses_the_decode_workers_cache(tiny_llama_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tiny_llama_path)
    ref = LLM(path, block_size=8, num_blocks=128)
    p = LLM(path, block_size=4, num_blocks=128)
    d = LLM(path, block_size=8, num_blocks=128)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 49000, (24,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 49000, (n,), generator=g).tolist() for n in (5, 7)]
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    got_a, have_a = _handoff_skipping_cached(p, d, prompts[0], "a")
    assert have_a == 0 and got_a == want[0]
    # the first request's received blocks were registered: the second reuses 3 blocks
    got_b, have_b = _handoff_skipping_cached(p, d, prompts[1], "b")
    assert have_b == 24 and got_b == want[1]
    assert d.engine.stats()["prefix_cache_hit_tokens"] >= 24
    assert d.engine.cached_block_hashes()
    stored, _, cleared = d.engine.take_kv_events()
    assert not cleared and set(hash_full_blocks(shared, 8)) <= set(stored)
    for llm in (ref, p, d):
        assert_engine_idle(llm)
        assert not llm.engine.scheduler.held and not llm.engine._reserved
    assert_no_leaks(d.engine.scheduler)
