"""The KVPool contract of api.py, on FakeKVPool and TieredKVPool over each tier alone and all
together: leading runs of chunks, namespace isolation, verified reads, non-blocking writes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvpool_factories import BLOCK, blocks, chain, kvpool_threads, namespace, put_chain
from pdserve.kvpool import FakeKVPool, KVPool, PoolNamespace, TieredKVPool
from pdserve.kvpool.disk import DiskTier
from pdserve.kvpool.redis_tier import RedisTier
from pdserve.kvpool.tiers import MemoryTier, Tier

MB = 1 << 20
TierFactory = Callable[[], Tier]


def _tiers(kind: str, request: pytest.FixtureRequest) -> list[Tier]:
    tiers: list[Tier] = []
    if kind in ("memory", "all"):
        tiers.append(MemoryTier(64 * MB))
    if kind in ("disk", "all"):
        tiers.append(DiskTier(request.getfixturevalue("tmp_path") / "pool", 64 * MB))
    if kind in ("redis", "all"):
        tiers.append(RedisTier(request.getfixturevalue("redis_url")))
    return tiers


@pytest.fixture(params=["fake", "memory", "disk", "redis", "all"])
def make_pool(request: pytest.FixtureRequest) -> Iterator[Callable[[PoolNamespace], KVPool]]:
    pools: list[KVPool] = []

    def make(ns: PoolNamespace) -> KVPool:
        pool: KVPool
        if request.param == "fake":
            pool = FakeKVPool(ns)
        else:
            pool = TieredKVPool(ns, _tiers(request.param, request))
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
    assert kvpool_threads() == []


def _put(pool: KVPool, hashes: list[bytes], kvs: list[torch.Tensor], start: int = 0) -> None:
    assert put_chain(pool, hashes, kvs, start)
    flush = getattr(pool, "flush", None)
    if flush is not None:
        assert flush(10.0)


def _later() -> float:
    return time.monotonic() + 10.0


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(map(torch.equal, got, want))


@pytest.mark.parametrize("c", [1, 3])
def test_round_trip_and_leading_run(make_pool: Callable[[PoolNamespace], KVPool], c: int) -> None:
    pool = make_pool(namespace(chunk_blocks=c))
    hashes, kvs = chain(6), blocks(6)
    assert pool.lookup(hashes) == 0 and pool.get(hashes, _later()) == []
    _put(pool, hashes[:4], kvs[:4])  # C=3: chunks [0-2] and [3] (a finished request's tail)
    assert pool.lookup(hashes) == 4
    assert _same(pool.get(hashes[:4], _later()), kvs[:4])
    assert pool.lookup([]) == 0 and pool.get([], _later()) == []


def test_chunk_boundaries_by_hand(make_pool: Callable[[PoolNamespace], KVPool]) -> None:
    """C=3. A 7-block prompt is stored as [0-2], [3-5] full and [6] partial; a 9-block prompt
    with the same first 7 blocks finds 7, and after its own write ([6-8] full) 9."""
    pool = make_pool(namespace(chunk_blocks=3))
    seven, nine, kvs = chain(7), chain(9), blocks(9)
    assert nine[:7] == seven  # chained hashes of the same tokens
    _put(pool, seven, kvs[:7])
    assert pool.lookup(seven) == 7 and pool.lookup(nine) == 7
    assert _same(pool.get(nine[:7], _later()), kvs[:7])
    _put(pool, nine, kvs, start=6)  # the 9-block request's own last chunk: [6-8]
    assert pool.lookup(nine) == 9
    assert _same(pool.get(nine, _later()), kvs)
    assert pool.lookup(seven) == 7  # the partial [6] is still its own key
    # A prefix that ends inside a stored full chunk finds only the chunks before it.
    assert pool.lookup(nine[:5]) == 3 and pool.lookup(nine[:8]) == 7


def test_partial_and_full_chunk_over_one_start(
    make_pool: Callable[[PoolNamespace], KVPool],
) -> None:
    pool = make_pool(namespace(chunk_blocks=3))
    hashes, kvs = chain(6), blocks(6)
    _put(pool, hashes[:5], kvs[:5])  # [0-2] and the partial [3-4]
    assert pool.lookup(hashes) == 5
    _put(pool, hashes, kvs, start=3)  # the full [3-5] over the same start
    assert pool.lookup(hashes) == 6 and pool.lookup(hashes[:5]) == 5
    assert _same(pool.get(hashes, _later()), kvs)
    assert _same(pool.get(hashes[:5], _later()), kvs[:5])


def test_a_missing_middle_chunk_stops_the_run(
    make_pool: Callable[[PoolNamespace], KVPool],
) -> None:
    pool = make_pool(namespace(chunk_blocks=3))
    hashes, kvs = chain(9), blocks(9)
    assert pool.put(0, hashes[:3], kvs[:3]) and pool.put(6, hashes[6:], kvs[6:])
    _put(pool, [], [])  # flush
    assert pool.lookup(hashes) == 3  # [3-5] is missing: [6-8] is not part of the run
    assert _same(pool.get(hashes[:3], _later()), kvs[:3])
    # get reads the chunks a run of len(hashes) blocks is made of: it stops at the missing one.
    assert _same(pool.get(hashes, _later()), kvs[:3])


def test_a_partial_chunk_ends_the_run(make_pool: Callable[[PoolNamespace], KVPool]) -> None:
    """Only a full chunk is followed: after a partial one nothing is known (its blocks after
    the tail were computed by another request, if at all)."""
    pool = make_pool(namespace(chunk_blocks=3))
    hashes, kvs = chain(6), blocks(6)
    assert pool.put(0, hashes[:2], kvs[:2]) and pool.put(3, hashes[3:], kvs[3:])
    _put(pool, [], [])
    assert pool.lookup(hashes) == 2


def test_a_run_from_a_later_block(make_pool: Callable[[PoolNamespace], KVPool]) -> None:
    """C=3. A caller whose local cache holds blocks 0-3 asks from block 4 (start=4): the chunk
    [3-5] is read whole and its block 3 dropped."""
    pool = make_pool(namespace(chunk_blocks=3))
    hashes, kvs = chain(9), blocks(9)
    _put(pool, hashes, kvs)
    assert pool.lookup(hashes[4:], start=4) == 5
    assert _same(pool.get(hashes[4:], _later(), start=4), kvs[4:])
    assert pool.lookup(hashes[4:8], start=4) == 2  # [6-8] is not addressed by blocks 4-7
    assert _same(pool.get(hashes[4:6], _later(), start=4), kvs[4:6])
    assert pool.lookup(hashes[6:], start=6) == 3 and pool.lookup(hashes[:4]) == 3


def test_returned_blocks_are_the_callers(make_pool: Callable[[PoolNamespace], KVPool]) -> None:
    pool = make_pool(namespace(chunk_blocks=2))
    hashes, kvs = chain(2), blocks(2)
    mine = [kv.clone() for kv in kvs]
    _put(pool, hashes, mine)
    for kv in mine:
        kv.zero_()  # the engine reuses its blocks after put: the pool kept a copy
    got = pool.get(hashes, _later())
    assert _same(got, kvs)
    got[0].zero_()  # and the caller may write into what get returned
    assert _same(pool.get(hashes, _later()), kvs)


@pytest.mark.parametrize("c", [1, 3])
def test_two_models_never_see_each_others_kv(
    make_pool: Callable[[PoolNamespace], KVPool], c: int
) -> None:
    a, b = namespace("model-a", chunk_blocks=c), namespace("model-b", chunk_blocks=c)
    pool_a = make_pool(a)
    hashes = chain(3)
    _put(pool_a, hashes, blocks(3))
    # Same tokens, same hashes: another model's pool over the same storage finds nothing.
    if isinstance(pool_a, FakeKVPool):
        pool_b: KVPool = FakeKVPool(b, blocks=pool_a.blocks)
    else:
        assert isinstance(pool_a, TieredKVPool)
        pool_b = TieredKVPool(b, pool_a.tiers, close_tiers=False)
    assert pool_b.lookup(hashes) == 0 and pool_b.get(hashes, _later()) == []
    assert pool_a.lookup(hashes) == 3
    if isinstance(pool_b, TieredKVPool):  # (a FakeKVPool's close would clear the shared dict)
        pool_b.close()
        assert pool_a.lookup(hashes) == 3


def test_another_chunk_size_is_another_namespace(
    make_pool: Callable[[PoolNamespace], KVPool],
) -> None:
    """Workers with different --kv-pool-chunk-mb would store other blocks under one key: the
    chunk size is part of the namespace, so they simply do not share."""
    three, two = namespace(chunk_blocks=3), namespace(chunk_blocks=2)
    assert three.digest() != two.digest()
    pool = make_pool(three)
    hashes = chain(3)
    _put(pool, hashes, blocks(3))
    other: KVPool
    if isinstance(pool, FakeKVPool):
        other = FakeKVPool(two, blocks=pool.blocks)
    else:
        assert isinstance(pool, TieredKVPool)
        other = TieredKVPool(two, pool.tiers, close_tiers=False)
    assert other.lookup(hashes) == 0 and other.get(hashes, _later()) == []
    if isinstance(other, TieredKVPool):
        other.close()


def test_past_deadline_returns_nothing(make_pool: Callable[[PoolNamespace], KVPool]) -> None:
    pool = make_pool(namespace())
    hashes = chain(2)
    _put(pool, hashes, blocks(2))
    if isinstance(pool, FakeKVPool):
        pytest.skip("FakeKVPool ignores deadlines (synchronous, in-process)")
    assert pool.get(hashes, time.monotonic() - 1.0) == []


def test_bad_chunks_are_refused(make_pool: Callable[[PoolNamespace], KVPool]) -> None:
    pool = make_pool(namespace(chunk_blocks=3))
    hashes, kvs = chain(4), blocks(4)
    for first, n in ((1, 2), (0, 4), (3, 0), (-3, 1)):  # unaligned, too long, empty, negative
        with pytest.raises(ValueError, match="chunk"):
            pool.put(first, hashes[:n], kvs[:n])
    with pytest.raises(ValueError, match="chunk"):
        pool.put(0, hashes[:2], kvs[:1])  # a tensor per block
    if isinstance(pool, FakeKVPool):
        return  # FakeKVPool stores whatever tensors it is given
    with pytest.raises(ValueError, match="block_size"):
        pool.put(0, hashes[:1], [torch.zeros(2, 2, BLOCK + 1, 2, 8)])
    with pytest.raises(ValueError, match="float32"):
        pool.put(0, hashes[:1], [torch.zeros(2, 2, BLOCK, 2, 8, dtype=torch.float16)])
