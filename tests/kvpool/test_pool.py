"""build_pool, promotion between tiers, the int8 storage codec, stats() and the metric names."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvpool_factories import SHAPE, blocks, chain, kvpool_threads, namespace, put_chain
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
        assert put_chain(pool, hashes, kvs)
        assert pool.flush()
        memory.close()  # as if evicted from memory: the disk still has them
        assert pool.lookup(hashes) == 4
        assert memory.stats.hit_blocks == 0 and disk.stats.hit_blocks == 4
        got = pool.get(hashes, _later())
        assert all(torch.equal(a, b) for a, b in zip(got, kvs, strict=True))
        assert disk.stats.get_blocks == 4
        keys = [pool.namespace.key(h) for h in hashes]
        assert all(memory.exists(keys))  # promoted
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
        assert put_chain(pool, hashes, kvs)
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
        assert put_chain(pool, hashes, kvs)
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
        assert put_chain(pool, hashes, kvs)
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
    assert pool.put(0, chain(1), blocks(1)) is False


def test_a_missed_deadline_is_counted(no_leaks: None) -> None:
    pool = TieredKVPool(namespace(), [MemoryTier(MB)])
    try:
        hashes, kvs = chain(2), blocks(2)
        assert put_chain(pool, hashes, kvs)
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
        assert put_chain(writer, hashes, kvs)
        assert writer.flush()
        assert reader.lookup(hashes) == 3
        got = reader.get(hashes, _later())
        assert all(torch.equal(a, b) for a, b in zip(got, kvs, strict=True))
        assert reader_disk.usage()["entries"] == 3  # adopted into its index
        assert reader.put(0, hashes[:1], kvs[:1]) and reader.flush()
        assert reader_disk.stats.puts == 0 and reader_disk.stats.present == 1
    finally:
        writer.close()
        reader.close()


@contextlib.contextmanager
def _memory_over_disk(tmp_path: Path) -> Iterator[tuple[Any, ...]]:
    """A memory tier over a disk tier at C=3, with a pool on each alone (to fill one tier) and
    one over both; all three closed afterwards."""
    memory, disk = MemoryTier(64 * MB), DiskTier(tmp_path, 64 * MB)
    ns = namespace(chunk_blocks=3)
    mem_only = TieredKVPool(ns, [memory], close_tiers=False)
    disk_only = TieredKVPool(ns, [disk], close_tiers=False)
    pool = TieredKVPool(ns, [memory, disk])
    try:
        yield memory, disk, mem_only, disk_only, pool
    finally:
        for p in (mem_only, disk_only, pool):
            p.close()


def test_chunks_across_tiers(tmp_path: Path, no_leaks: None) -> None:
    """C=3. Memory holds [0-2] and a partial [3-4]; the disk holds [0-2] and the full [3-5]:
    the run is 6 (the disk's full chunk outgrows memory's partial one), read [0-2] from memory
    and [3-5] from the disk, which is then promoted."""
    with _memory_over_disk(tmp_path) as (memory, disk, mem_only, disk_only, pool):
        ns = pool.namespace
        hashes, kvs = chain(6), blocks(6)
        assert put_chain(mem_only, hashes[:5], kvs[:5]) and mem_only.flush()
        assert put_chain(disk_only, hashes, kvs) and disk_only.flush()
        assert pool.lookup(hashes) == 6
        assert memory.stats.hit_blocks == 3 and disk.stats.hit_blocks == 3
        assert memory.stats.lookup_blocks == 6 and disk.stats.lookup_blocks == 3
        got = pool.get(hashes, _later())
        assert len(got) == 6 and all(map(torch.equal, got, kvs))
        assert memory.stats.get_blocks == 3 and disk.stats.get_blocks == 3
        assert memory.exists([ns.key(hashes[5])]) == [True]  # promoted as one chunk
        assert pool.lookup(hashes[:5]) == 5  # the partial chunk is still memory's


def test_chunks_across_tiers_from_a_later_block(tmp_path: Path, no_leaks: None) -> None:
    """C=3, from block 4: memory's partial [3-4] gives block 4, the disk's full [3-5] outgrows
    it (block 3 read and dropped), and the run goes on in the disk."""
    with _memory_over_disk(tmp_path) as (memory, disk, mem_only, disk_only, pool):
        hashes, kvs = chain(9), blocks(9)
        assert put_chain(mem_only, hashes[:5], kvs[:5]) and mem_only.flush()
        assert put_chain(disk_only, hashes, kvs, start=3) and disk_only.flush()
        assert pool.lookup(hashes[4:], start=4) == 5
        assert memory.stats.hit_blocks == 0 and disk.stats.hit_blocks == 5
        got = pool.get(hashes[4:], _later(), start=4)
        assert len(got) == 5 and all(map(torch.equal, got, kvs[4:]))


def test_chunk_values_hold_their_blocks(no_leaks: None) -> None:
    """One value per chunk: 7 blocks at C=3 are 3 entries, of 3, 3 and 1 blocks."""
    ns = namespace(chunk_blocks=3)
    memory = MemoryTier(64 * MB)
    pool = TieredKVPool(ns, [memory])
    try:
        hashes, kvs = chain(7), blocks(7)
        assert put_chain(pool, hashes, kvs) and pool.flush()
        one = value_nbytes(len(ns.key(hashes[0])), SHAPE, torch.float32, "none")
        three = value_nbytes(len(ns.key(hashes[0])), SHAPE, torch.float32, "none", blocks=3)
        assert memory.usage()["entries"] == 3 and memory.usage()["bytes"] == 2 * three + one
        assert pool.stats()["namespace"]["chunk_blocks"] == 3  # type: ignore[index]
        assert pool.registry.get_sample_value("pdserve_kvpool_chunk_blocks") == 3
    finally:
        pool.close()


def test_chunk_size_from_the_target_bytes() -> None:
    """The default model's block, [30, 2, 16, 3, 64] float32, is ~720 KiB stored: 2 MiB makes
    3 blocks; int8 stores a quarter, so 11; always 1..MAX_CHUNK_BLOCKS."""
    from pdserve.kvpool.api import MAX_CHUNK_BLOCKS, chunk_blocks_for

    block = (30, 2, 16, 3, 64)
    raw = value_nbytes(48, block, torch.float32, "none")
    int8 = value_nbytes(48, block, torch.float32, "int8")
    assert chunk_blocks_for(2.0, raw) == 3 and chunk_blocks_for(2.0, int8) == 11
    assert chunk_blocks_for(0.01, raw) == 1 and chunk_blocks_for(1e6, raw) == MAX_CHUNK_BLOCKS
    with pytest.raises(ValueError, match="chunk-mb"):
        KVPoolConfig(chunk_mb=0.0)
    with pytest.raises(ValueError, match="chunk_blocks"):
        namespace(chunk_blocks=0)
