"""The KVPool contract of api.py, on FakeKVPool and TieredKVPool over each tier alone and all
together: leading runs, namespace isolation, verified reads, non-blocking writes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvpool_factories import BLOCK, blocks, chain, kvpool_threads, namespace
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


def _put_all(pool: KVPool, hashes: list[bytes], kvs: list[torch.Tensor]) -> None:
    for h, kv in zip(hashes, kvs, strict=True):
        assert pool.put(h, kv)
    flush = getattr(pool, "flush", None)
    if flush is not None:
        assert flush(10.0)


def _later() -> float:
    return time.monotonic() + 10.0


def test_round_trip_and_leading_run(make_pool: Callable[[PoolNamespace], KVPool]) -> None:
    pool = make_pool(namespace())
    hashes, kvs = chain(6), blocks(6)
    assert pool.lookup(hashes) == 0 and pool.get(hashes, _later()) == []
    _put_all(pool, hashes[:4], kvs[:4])
    assert pool.lookup(hashes) == 4
    got = pool.get(hashes, _later())
    assert len(got) == 4
    assert all(torch.equal(a, b) for a, b in zip(got, kvs, strict=False))
    # A run starts at the first hash: a gap ends it even when later blocks are present.
    _put_all(pool, hashes[5:], kvs[5:])
    assert pool.lookup(hashes) == 4 and len(pool.get(hashes, _later())) == 4
    assert pool.lookup(hashes[5:]) == 1


def test_returned_blocks_are_the_callers(make_pool: Callable[[PoolNamespace], KVPool]) -> None:
    pool = make_pool(namespace())
    hashes, kvs = chain(1), blocks(1)
    kv = kvs[0].clone()
    _put_all(pool, hashes, [kv])
    kv.zero_()  # the engine reuses its block after put: the pool kept a copy
    (got,) = pool.get(hashes, _later())
    assert torch.equal(got, kvs[0])
    got.zero_()  # and the caller may write into what get returned
    assert torch.equal(pool.get(hashes, _later())[0], kvs[0])


def test_two_models_never_see_each_others_kv(
    make_pool: Callable[[PoolNamespace], KVPool],
) -> None:
    a, b = namespace("model-a"), namespace("model-b")
    pool_a = make_pool(a)
    hashes = chain(3)
    _put_all(pool_a, hashes, blocks(3))
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


def test_past_deadline_returns_nothing(make_pool: Callable[[PoolNamespace], KVPool]) -> None:
    pool = make_pool(namespace())
    hashes = chain(2)
    _put_all(pool, hashes, blocks(2))
    if isinstance(pool, FakeKVPool):
        pytest.skip("FakeKVPool ignores deadlines (synchronous, in-process)")
    assert pool.get(hashes, time.monotonic() - 1.0) == []


def test_bad_blocks_are_refused(make_pool: Callable[[PoolNamespace], KVPool]) -> None:
    pool = make_pool(namespace())
    if isinstance(pool, FakeKVPool):
        pytest.skip("FakeKVPool stores whatever it is given")
    with pytest.raises(ValueError, match="block_size"):
        pool.put(chain(1)[0], torch.zeros(2, 2, BLOCK + 1, 2, 8))
    with pytest.raises(ValueError, match="float32"):
        pool.put(chain(1)[0], torch.zeros(2, 2, BLOCK, 2, 8, dtype=torch.float16))
