"""KV groups' namespaces (engine/pool_link.py): a namespace naming some layers has its own digest
(the every-layer digest is unchanged), and a pool under a group's namespace (`for_namespace`)
shares the store, the write-back and the lifetime of its pool but none of its keys."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvpool_factories import BLOCK, chain, kvpool_threads, namespace, put_chain
from pdserve.kvpool import FakeKVPool, KVPool, TieredKVPool
from pdserve.kvpool.tiers import MemoryTier

MB = 1 << 20


def _group_blocks(n: int, layers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(layers)
    return [torch.randn((layers, 2, BLOCK, 2, 8), generator=g) for _ in range(n)]


def test_a_group_namespace_names_its_layers() -> None:
    ns = namespace(chunk_blocks=3)
    full, sliding = ns.for_layers([1], 3), ns.for_layers([0], 1)
    assert (full.layers, sliding.layers, sliding.chunk_blocks) == ("1", "0", 1)
    assert len({ns.digest(), full.digest(), sliding.digest()}) == 3
    assert ns.digest() == replace(ns, layers="").digest()
    assert full.digest() != replace(full, layers="0").digest()
    with pytest.raises(ValueError, match="no sub-groups"):
        full.for_layers([1], 3)
    for bad in ([], [1, 0], [0, 0], [-1]):
        with pytest.raises(ValueError, match="ascending"):
            ns.for_layers(bad, 1)


def _pools(kind: str) -> KVPool:
    if kind == "fake":
        return FakeKVPool(namespace(chunk_blocks=2))
    return TieredKVPool(namespace(chunk_blocks=2), [MemoryTier(64 * MB)])


@pytest.mark.parametrize("kind", ["fake", "tiered"])
def test_a_group_s_pool_shares_the_store_not_the_keys(kind: str) -> None:
    pool = _pools(kind)
    ns = pool.namespace
    sliding = pool.for_namespace(ns.for_layers([0], 1))
    full = pool.for_namespace(ns.for_layers([1], 2))
    hashes, kvs = chain(5), _group_blocks(5, 1)
    try:
        assert put_chain(sliding, hashes, kvs)
        if isinstance(pool, TieredKVPool):
            assert pool.flush()
        assert sliding.lookup(hashes) == 5
        assert pool.lookup(hashes) == 0 and full.lookup(hashes) == 0
        got = sliding.get(hashes[2:], deadline=float("inf"), start=2)
        assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, kvs[2:], strict=True))
        with pytest.raises(ValueError, match="not a KV group"):
            pool.for_namespace(replace(ns.for_layers([0], 1), codec="int8"))
        with pytest.raises(ValueError, match="not a KV group"):
            pool.for_namespace(ns)
        sliding.close()  # a group's pool leaves its pool open
        assert full.put(0, hashes[:2], _group_blocks(2, 1))
    finally:
        pool.close()
    assert kvpool_threads() == []
