"""router.prefix_index: per-worker sets of cached block hashes fed by KVEvents, prefix matching."""

from __future__ import annotations

from pdserve.engine.block_pool import hash_full_blocks
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, SamplingParams
from pdserve.router.prefix_index import PrefixIndex
from pdserve.workers.messages import KVEvents

BS = 4


def ev(
    wid: str,
    seq: int,
    stored: list[bytes] = (),  # type: ignore[assignment]
    removed: list[bytes] = (),  # type: ignore[assignment]
    cleared: bool = False,
    block_size: int = BS,
) -> KVEvents:
    return KVEvents(wid, seq, block_size, list(stored), list(removed), cleared)


def test_snapshot_then_deltas_match_the_longest_leading_run() -> None:
    prompt = list(range(20))  # 5 full blocks
    h = hash_full_blocks(prompt, BS)
    idx = PrefixIndex()
    idx.apply(ev("D0", 0, h[:2], cleared=True))
    idx.apply(ev("D1", 0, cleared=True))
    assert idx.match(prompt, BS, ["D0", "D1"]) == {"D0": 8, "D1": 0}
    idx.apply(ev("D0", 1, [h[2], h[4]]))  # block 3 missing: the run stops at 3 blocks
    idx.apply(ev("D1", 1, [h[1]]))  # without block 0 nothing counts
    assert idx.match(prompt, BS, ["D0", "D1", "nobody"]) == {"D0": 12, "D1": 0, "nobody": 0}
    idx.apply(ev("D0", 2, removed=[h[0]]))
    assert idx.match(prompt, BS) == {"D0": 0, "D1": 0}
    assert not idx.needs_resync("D0") and idx.needs_resync("nobody")
    assert idx.stats() == {
        "workers": 2,
        "hashes": {"D0": 3, "D1": 1},
        "untrusted": [],
        "gaps": 0,
    }


def test_whole_prompt_and_partial_tail() -> None:
    prompt = list(range(10))  # 2 full blocks and 2 tokens that never count
    idx = PrefixIndex()
    idx.apply(ev("W", 0, hash_full_blocks(prompt, BS), cleared=True))
    assert idx.match(prompt, BS, ["W"]) == {"W": 8}
    assert idx.match(prompt[:3], BS, ["W"]) == {"W": 0}


def test_a_seq_gap_makes_the_worker_untrusted_until_a_snapshot() -> None:
    prompt = list(range(8))
    h = hash_full_blocks(prompt, BS)
    idx = PrefixIndex()
    idx.apply(ev("W", 0, h, cleared=True))
    idx.apply(ev("W", 2, removed=[h[1]]))  # seq 1 was lost
    assert idx.needs_resync("W") and idx.match(prompt, BS, ["W"]) == {"W": 0}
    idx.apply(ev("W", 3, h))  # still untrusted: deltas cannot repair a gap
    assert idx.needs_resync("W") and idx.match(prompt, BS, ["W"]) == {"W": 0}
    assert idx.stats()["untrusted"] == ["W"] and idx.stats()["gaps"] == 1
    idx.apply(ev("W", 0, h[:1], cleared=True))  # the resync (Hello again) starts at 0
    assert not idx.needs_resync("W") and idx.match(prompt, BS, ["W"]) == {"W": 4}
    idx.apply(ev("W", 1, [h[1]]))
    assert idx.match(prompt, BS, ["W"]) == {"W": 8}


def test_a_delta_before_any_snapshot_is_not_trusted() -> None:
    prompt = list(range(8))
    idx = PrefixIndex()
    idx.apply(ev("W", 5, hash_full_blocks(prompt, BS)))
    assert idx.needs_resync("W") and idx.match(prompt, BS, ["W"]) == {"W": 0}


def test_cleared_replaces_and_drop_forgets() -> None:
    prompt = list(range(8))
    h = hash_full_blocks(prompt, BS)
    idx = PrefixIndex()
    idx.apply(ev("W", 0, h, cleared=True))
    idx.apply(ev("W", 1, [], cleared=True))  # e.g. the buffer overflowed: whole set, now empty
    assert idx.match(prompt, BS, ["W"]) == {"W": 0} and not idx.needs_resync("W")
    idx.apply(ev("W", 2, h))
    assert idx.match(prompt, BS, ["W"]) == {"W": 8}
    idx.drop("W")
    assert idx.match(prompt, BS, ["W"]) == {"W": 0} and idx.needs_resync("W")
    assert idx.stats()["workers"] == 0
    idx.drop("never-seen")  # harmless


def test_workers_with_other_block_sizes_are_matched_at_their_own() -> None:
    prompt = list(range(40))
    idx = PrefixIndex()
    idx.apply(ev("P", 0, hash_full_blocks(prompt[:16], 4), cleared=True, block_size=4))
    idx.apply(ev("D", 0, hash_full_blocks(prompt[:32], 16), cleared=True, block_size=16))
    assert idx.match(prompt, 4, ["P", "D"]) == {"P": 16, "D": 32}
    idx.apply(ev("P", 1, block_size=16))  # a different block size mid-stream: resync
    assert idx.needs_resync("P")


def test_the_index_agrees_with_an_engine_cache_fed_by_its_events() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    idx, seq = PrefixIndex(), 0
    idx.apply(ev("W", seq, kv.cached_hashes(), cleared=True))

    def run(rid: str, prompt: list[int]) -> None:
        nonlocal seq
        req = Request(rid, prompt, SamplingParams(max_tokens=1), ())
        hit = kv.find_cached_prefix(req)
        assert kv.allocate_slots(req, len(prompt) - hit.num_tokens, hit) is not None
        kv.free(rid)
        stored, removed, cleared = kv.take_events()
        seq += 1
        idx.apply(ev("W", seq, stored, removed, cleared))

    a, b = list(range(16)), list(range(100, 120))
    run("a", a)
    assert idx.match(a, BS, ["W"])["W"] == 16
    run("b", b)  # 5 blocks of 6: evicts most of a's prefix
    for prompt in (a, b):
        probe = Request("probe", [*prompt, 7], SamplingParams(max_tokens=1), ())
        want = kv.find_cached_prefix(probe).num_tokens
        kv.free("probe")
        assert idx.match(prompt, BS, ["W"])["W"] == want
    assert idx.stats()["hashes"]["W"] == len(kv.cached_hashes())


def test_long_prompt_many_workers() -> None:
    # (speed is measured, not asserted: a 4000-token prompt hashes once, ~250 set lookups each)
    prompt = list(range(4000))
    h = hash_full_blocks(prompt, 16)
    idx = PrefixIndex()
    workers = [f"W{i}" for i in range(16)]
    for i, wid in enumerate(workers):
        idx.apply(ev(wid, 0, h[: 15 * i], cleared=True, block_size=16))
    got = idx.match(prompt, 16, workers)
    assert got == {wid: 15 * i * 16 for i, wid in enumerate(workers)}
