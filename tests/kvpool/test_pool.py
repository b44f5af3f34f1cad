"""build_pool, promotion between tiers, the int8 storage codec, stats() and the metric names."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvpool_factories import SHAPE, blocks, chain, kvpool_threads, namespace
from pdserve.kvpool import KVPoolConfig, TieredKVPool, build_pool
from pdserve.kvpool.disk import DiskTier
from pdserve.kvpool.redis_tier import RedisTier
from pdserve.kvpool.tiers import MemoryTier
from pdserve.kvpool.values import value_nbytes

MB = 1 << 20


@pytest.fixture
def no_leaks() -> Iterator[None]:
    yield
    assert kvpool_threads() == []


def _later() -> float:
    return time.monotonic() + 10.0


def test_build_pool_is_none_without_tiers(no_leaks: None) -> None:
    assert build_pool(KVPoolConfig(), namespace()) is None


def test_build_pool_makes_the_configured_tiers_fastest_first(
    tmp_path: Path, redis_url: str, no_leaks: None
) -> None:
    config = KVPoolConfig(memory_gb=0.01, disk_dir=str(tmp_path), disk_gb=0.02, redis_url=redis_url)
    registry = CollectorRegistry()
    pool = build_pool(config, namespace(), registry)
    assert isinstance(pool, TieredKVPool)
    try:
        assert [t.name for t in pool.tiers] == ["memory", "disk", "redis"]
        assert pool.registry is registry
        usage = pool.stats()["tiers"]
        assert isinstance(usage, dict)
        assert usage["memory"]["capacity_bytes"] == int(0.01 * (1 << 30))
        assert usage["disk"]["capacity_bytes"] == int(0.02 * (1 << 30))
        assert usage["redis"]["up"] is True and usage["redis"]["capacity_bytes"] > 0
        assert json.loads(json.dumps(pool.stats()))["tiers"].keys() == usage.keys()  # /admin
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"memory_gb": -1.0}, ">= 0"), ({"disk_gb": -2.0}, ">= 0")]
)
def test_bad_config_is_a_value_error(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVPoolConfig(**kwargs)  # type: ignore[arg-type]


def test_lower_tier_hits_are_promoted_to_memory(tmp_path: Path, no_leaks: None) -> None:
    memory, disk = MemoryTier(64 * MB), DiskTier(tmp_path, 64 * MB)
    pool = TieredKVPool(namespace(), [memory, disk])
    try:
        hashes, kvs = chain(4), blocks(4)
        for h, kv in zip(hashes, kvs, strict=True):
            pool.put(h, kv)
        assert pool.flush()
        memory.close()  # as if evicted from memory: the disk still has them
        assert pool.lookup(hashes) == 4
        assert memory.stats.hit_blocks == 0 and disk.stats.hit_blocks == 4
        got = pool.get(hashes, _later())
        assert all(torch.equal(a, b) for a, b in zip(got, kvs, strict=True))
        assert disk.stats.get_blocks == 4
        keys = [pool.namespace.key(h) for h in hashes]
        assert memory.contains(keys) == 4  # promoted
        pool.get(hashes, _later())
        assert disk.stats.get_blocks == 4 and memory.stats.get_blocks == 4
    finally:
        pool.close()


def test_a_run_continues_in_the_next_tier(tmp_path: Path, no_leaks: None) -> None:
    """Memory has blocks 0-1, disk has 0-3: the pool's run is 4, read from both."""
    memory, disk = MemoryTier(64 * MB), DiskTier(tmp_path, 64 * MB)
    pool = TieredKVPool(namespace(), [memory, disk])
    try:
        hashes, kvs = chain(4), blocks(4)
        for h, kv in zip(hashes, kvs, strict=True):
            pool.put(h, kv)
        assert pool.flush()
        keys = [pool.namespace.key(h) for h in hashes]
        memory.delete(keys[2])
        memory.delete(keys[3])
        assert pool.lookup(hashes) == 4
        assert memory.stats.hit_blocks == 2 and disk.stats.hit_blocks == 2
        got = pool.get(hashes, _later())
        assert all(torch.equal(a, b) for a, b in zip(got, kvs, strict=True))
    finally:
        pool.close()


def test_int8_namespace_stores_a_quarter_and_decodes_close(redis_url: str, no_leaks: None) -> None:
    ns = namespace(codec="int8")
    pool = TieredKVPool(ns, [MemoryTier(64 * MB), RedisTier(redis_url)])
    try:
        hashes, kvs = chain(2), blocks(2)
        for h, kv in zip(hashes, kvs, strict=True):
            pool.put(h, kv)
        assert pool.flush()
        got = pool.get(hashes, _later())
        assert len(got) == 2
        for a, b in zip(got, kvs, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            # symmetric int8: within half a step of each (16-token group, head)'s absmax / 127
            assert (a - b).abs().max() <= b.abs().max() / 127 / 2 + 1e-6
        raw = value_nbytes(len(ns.key(hashes[0])), SHAPE, torch.float32, "none")
        stored = pool.stats()["tiers"]["memory"]["bytes"]  # type: ignore[index]
        assert stored < 2 * raw / 3
    finally:
        pool.close()


def test_metric_names_per_tier(tmp_path: Path, no_leaks: None) -> None:
    pool = TieredKVPool(namespace(), [MemoryTier(64 * MB), DiskTier(tmp_path, 64 * MB)])
    try:
        hashes, kvs = chain(3), blocks(3)
        for h, kv in zip(hashes, kvs, strict=True):
            pool.put(h, kv)
        assert pool.flush()
        pool.lookup(hashes + chain(1, seed=3))
        pool.get(hashes, _later())
        sample = pool.registry.get_sample_value
        for tier in ("memory", "disk"):
            assert sample("pdserve_kvpool_lookups_total", {"tier": tier}) == 1
            assert sample("pdserve_kvpool_puts_total", {"tier": tier}) == 3
            assert sample("pdserve_kvpool_put_seconds_count", {"tier": tier}) == 3
            assert sample("pdserve_kvpool_entries", {"tier": tier}) == 3
            assert sample("pdserve_kvpool_up", {"tier": tier}) == 1
        assert sample("pdserve_kvpool_hit_blocks_total", {"tier": "memory"}) == 3
        assert sample("pdserve_kvpool_hit_tokens_total", {"tier": "memory"}) == 3 * 16
        assert sample("pdserve_kvpool_lookup_blocks_total", {"tier": "disk"}) == 1
        assert sample("pdserve_kvpool_hit_rate", {"tier": "memory"}) == 0.75
        assert sample("pdserve_kvpool_get_seconds_count", {"tier": "memory"}) == 3
        written = sample("pdserve_kvpool_written_bytes_total", {"tier": "memory"})
        assert written == sample("pdserve_kvpool_used_bytes", {"tier": "memory"}) > 0
        assert sample("pdserve_kvpool_read_bytes_total", {"tier": "memory"}) == written
        assert sample("pdserve_kvpool_queue_depth", {}) == 0
    finally:
        pool.close()


def test_close_is_idempotent_and_put_after_close_is_refused(no_leaks: None) -> None:
    pool = TieredKVPool(namespace(), [MemoryTier(MB)])
    pool.close()
    pool.close()
    assert pool.put(chain(1)[0], blocks(1)[0]) is False


def test_a_missed_deadline_is_counted(no_leaks: None) -> None:
    pool = TieredKVPool(namespace(), [MemoryTier(MB)])
    try:
        hashes, kvs = chain(2), blocks(2)
        for h, kv in zip(hashes, kvs, strict=True):
            pool.put(h, kv)
        assert pool.flush()
        assert pool.get(hashes, time.monotonic() - 1.0) == []
        assert pool.stats()["deadline_misses"] == 1
        assert pool.registry.get_sample_value("pdserve_kvpool_deadline_misses_total") == 1
        assert len(pool.get(hashes, _later())) == 2 and pool.stats()["deadline_misses"] == 1
    finally:
        pool.close()


def test_workers_on_one_host_share_a_disk_directory(tmp_path: Path, no_leaks: None) -> None:
    writer = TieredKVPool(namespace(), [DiskTier(tmp_path, 64 * MB)])
    reader_disk = DiskTier(tmp_path, 64 * MB)  # started before anything was written
    reader = TieredKVPool(namespace(), [reader_disk])
    try:
        hashes, kvs = chain(3), blocks(3)
        for h, kv in zip(hashes, kvs, strict=True):
            writer.put(h, kv)
        assert writer.flush()
        assert reader.lookup(hashes) == 3
        got = reader.get(hashes, _later())
        assert all(torch.equal(a, b) for a, b in zip(got, kvs, strict=True))
        assert reader_disk.usage()["entries"] == 3  # adopted into its index
        assert reader.put(hashes[0], kvs[0]) and reader.flush()
        assert reader_disk.stats.puts == 0 and reader_disk.stats.present == 1
    finally:
        writer.close()
        reader.close()
