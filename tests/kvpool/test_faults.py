"""Faults of the pool's tiers: full write-back queue, failed and partial writes, corrupt values,
truncated files, disk full, a Redis killed and restarted; after each the pool keeps serving,
only ever verified blocks, and counts what happened."""

from __future__ import annotations

import errno
import logging
import shutil
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis
import torch
from prometheus_client import CollectorRegistry

from kvpool_factories import blocks, chain, kvpool_threads, namespace, put_chain
from kvpool_redis import RedisServer
from pdserve.kvpool import TieredKVPool
from pdserve.kvpool.disk import DiskTier
from pdserve.kvpool.redis_tier import PREFIX, RedisTier
from pdserve.kvpool.tiers import MemoryTier, Tier

MB = 1 << 20


def _later() -> float:
    return time.monotonic() + 10.0


@pytest.fixture
def pools() -> Iterator[list[TieredKVPool]]:
    made: list[TieredKVPool] = []
    yield made
    for pool in made:
        pool.close()
    assert kvpool_threads() == []


def _pool(
    made: list[TieredKVPool], tiers: Sequence[Tier], chunk_blocks: int = 1, **kw: object
) -> TieredKVPool:
    ns = namespace(chunk_blocks=chunk_blocks)
    pool = TieredKVPool(ns, tiers, **kw)  # type: ignore[arg-type]
    made.append(pool)
    return pool


def _fill(pool: TieredKVPool, n: int, seed: int = 0) -> tuple[list[bytes], list[torch.Tensor]]:
    hashes, kvs = chain(n, seed), blocks(n, seed)
    assert put_chain(pool, hashes, kvs)
    assert pool.flush(10.0)
    return hashes, kvs


def _sample(pool: TieredKVPool, name: str, tier: str | None = None) -> float:
    labels = {"tier": tier} if tier is not None else {}
    value = pool.registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


# ---- the write-back queue ----------------------------------------------------------------------
class GatedTier(MemoryTier):
    """A memory tier whose writes wait for a gate: a slow disk or network, on demand."""

    def __init__(self) -> None:
        super().__init__(64 * MB)
        self.gate = threading.Event()
        self.writing = threading.Event()

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        self.writing.set()
        assert self.gate.wait(10.0)
        return super().put_many(items)


def test_full_queue_drops_and_counts_without_blocking(pools: list[TieredKVPool]) -> None:
    """C=2, a queue of 4 blocks: 2 chunks wait while the writer is stuck on a third."""
    tier = GatedTier()
    pool = _pool(pools, [tier], chunk_blocks=2, queue_size=4)
    hashes, kvs = chain(10), blocks(10)

    def put(p: int) -> bool:
        return pool.put(p, hashes[p : p + 2], kvs[p : p + 2])

    assert put(0)
    assert tier.writing.wait(10.0)  # the writer holds chunk [0-1], stuck in the tier
    assert put(2) and put(4)  # the queue is full
    assert not put(6) and not put(8)
    assert pool.stats()["drops"] == 2 and _sample(pool, "pdserve_kvpool_queue_drops_total") == 2
    assert _sample(pool, "pdserve_kvpool_queue_depth") == 2
    assert pool.lookup(hashes) == 0  # nothing is visible before it is written
    tier.gate.set()
    assert pool.flush(10.0)
    assert pool.lookup(hashes) == 6


def test_a_block_already_in_memory_is_not_copied_again(pools: list[TieredKVPool]) -> None:
    pool = _pool(pools, [MemoryTier(64 * MB)], queue_size=1)
    hashes, kvs = _fill(pool, 1)
    for _ in range(5):  # a full queue would drop these if they were enqueued
        assert pool.put(0, hashes, kvs)
    assert pool.stats()["drops"] == 0


def test_a_failing_write_keeps_the_writer_alive(
    pools: list[TieredKVPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = _pool(pools, [MemoryTier(64 * MB)])
    real = pool._write
    calls = {"n": 0}

    def flaky(batch: list[tuple[bytes, int, torch.Tensor]]) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in a tier")
        real(batch)

    monkeypatch.setattr(pool, "_write", flaky)
    first, _ = _fill(pool, 1)  # lost, counted
    second, _ = _fill(pool, 1, seed=1)
    assert pool.lookup(first) == 0 and pool.lookup(second) == 1
    assert pool.stats()["write_errors"] == 1
    assert _sample(pool, "pdserve_kvpool_write_errors_total") == 1


# ---- failed and partial writes -----------------------------------------------------------------
def test_failed_disk_write_is_never_visible(
    pools: list[TieredKVPool], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = DiskTier(tmp_path, 64 * MB)

    def torn_replace(src: str, dst: str) -> None:
        raise OSError(errno.EIO, "I/O error")  # the rename never happens

    monkeypatch.setattr("pdserve.kvpool.disk.os.replace", torn_replace)
    pool = _pool(pools, [disk])
    hashes, _ = _fill(pool, 2)
    assert pool.lookup(hashes) == 0 and pool.get(hashes, _later()) == []
    assert list(tmp_path.rglob("*.kv")) == [] and list(tmp_path.rglob("*.tmp")) == []
    assert disk.stats.errors == 1 and disk.failed is not None


def test_partial_file_left_by_a_crash_is_never_served(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 64 * MB)
    key = namespace().key(chain(1)[0])
    path = disk.path(key)
    path.parent.mkdir(parents=True)
    tmp = path.with_name(path.name + ".123.456.tmp")
    tmp.write_bytes(b"PDKVPOOL half a value")  # a writer died before its rename
    again = DiskTier(tmp_path, 64 * MB)  # the next start
    assert again.exists([key]) == [False] and again.get_many([key], _later()) == []
    assert tmp.exists()  # fresh: maybe a live writer's; removed once stale


def _corrupt_memory(tier: MemoryTier, key: bytes) -> None:
    value = bytearray(tier._values[key])
    value[len(value) // 2] ^= 0xFF
    tier._values[key] = bytes(value)


@pytest.mark.parametrize("how", ["memory-flip", "disk-flip", "disk-truncate", "redis-garbage"])
def test_corrupt_value_is_deleted_counted_and_ends_the_run(
    how: str, pools: list[TieredKVPool], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    kind = how.split("-")[0]
    tier: Tier
    if kind == "memory":
        tier = MemoryTier(64 * MB)
    elif kind == "disk":
        tier = DiskTier(tmp_path, 64 * MB)
    else:
        tier = RedisTier(request.getfixturevalue("redis_url"))
    pool = _pool(pools, [tier], chunk_blocks=2)
    hashes, kvs = _fill(pool, 4)  # chunks [0-1] and [2-3]: the second is corrupted
    bad = pool.namespace.key(hashes[3])
    if how == "memory-flip":
        assert isinstance(tier, MemoryTier)
        _corrupt_memory(tier, bad)
    elif how == "disk-flip":
        assert isinstance(tier, DiskTier)
        data = bytearray(tier.path(bad).read_bytes())
        data[-100] ^= 0x01
        tier.path(bad).write_bytes(bytes(data))
    elif how == "disk-truncate":
        assert isinstance(tier, DiskTier)
        data = tier.path(bad).read_bytes()
        tier.path(bad).write_bytes(data[: len(data) // 3])
    else:
        assert isinstance(tier, RedisTier)
        tier.client.set(PREFIX + bad, b"PDKVPOOL\x01\x00 not a value")
    assert pool.lookup(hashes) == 4  # lookup does not read values
    got = pool.get(hashes, _later())
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, kvs, strict=False))
    assert tier.stats.corrupt == 1
    assert _sample(pool, "pdserve_kvpool_corrupt_total", tier.name) == 1
    assert pool.lookup(hashes) == 2  # deleted: the caller recomputes blocks 2-3, rewrites them


def test_value_under_another_key_is_refused(pools: list[TieredKVPool]) -> None:
    """A value copied under another key (e.g. a file renamed by hand) is not served."""
    tier = MemoryTier(64 * MB)
    pool = _pool(pools, [tier])
    hashes, _ = _fill(pool, 1)
    other = chain(1, seed=9)[0]
    tier._values[pool.namespace.key(other)] = tier._values[pool.namespace.key(hashes[0])]
    assert pool.get([other], _later()) == [] and tier.stats.corrupt == 1


# ---- disk full / unusable ----------------------------------------------------------------------
def test_disk_full_degrades_to_no_disk_tier_logged_once(
    pools: list[TieredKVPool],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    memory, disk = MemoryTier(64 * MB), DiskTier(tmp_path, 64 * MB)
    pool = _pool(pools, [memory, disk])
    first, _ = _fill(pool, 2, seed=1)
    assert all(disk.exists([pool.namespace.key(h) for h in first]))

    def full(self: DiskTier, key: bytes, value: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "_write", full)
    with caplog.at_level(logging.ERROR, logger="pdserve.kvpool"):
        for seed in (2, 3, 4):
            hashes, kvs = _fill(pool, 2, seed=seed)
            # The memory tier still serves what the disk could not take.
            got = pool.get(hashes, _later())
            assert pool.lookup(hashes) == len(got) == 2 and all(map(torch.equal, got, kvs))
    assert len([r for r in caplog.records if "disabled" in r.message]) == 1
    assert disk.failed is not None and "No space" in disk.failed
    assert disk.stats.errors == 1 and disk.stats.skipped > 0
    assert _sample(pool, "pdserve_kvpool_up", "disk") == 0
    assert _sample(pool, "pdserve_kvpool_errors_total", "disk") == 1
    memory.close()  # no disk tier anymore: what only it had is gone, never half-served
    assert pool.lookup(first) == 0


def test_unusable_disk_dir_degrades_at_start(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    disk = DiskTier(tmp_path / "a-file" / "pool", 64 * MB)
    assert disk.failed is not None and disk.usage()["up"] is False
    assert disk.put_many([(b"k", b"v")]) == 0 and disk.exists([b"k"]) == [False]


def test_disk_cap_evicts_least_recently_used(pools: list[TieredKVPool], tmp_path: Path) -> None:
    probe = DiskTier(tmp_path / "probe", 64 * MB)
    probe_pool = _pool(pools, [probe])
    _fill(probe_pool, 1)
    one = int(probe.usage()["bytes"])  # type: ignore[call-overload]
    disk = DiskTier(tmp_path / "pool", int(one * 2.5))
    pool = _pool(pools, [disk])
    hashes, _ = _fill(pool, 2)
    pool.get(hashes[:1], _later())  # block 0 is now the most recently used
    more, _ = _fill(pool, 1, seed=5)
    keys = [pool.namespace.key(h) for h in hashes]
    assert disk.exists(keys) == [True, False]
    assert disk.exists([pool.namespace.key(more[0])]) == [True]
    assert not disk.path(keys[1]).exists() and disk.stats.evictions == 1
    assert disk.usage()["entries"] == 2
    # A restart indexes the files it finds: the tier survives its worker.
    again = DiskTier(tmp_path / "pool", int(one * 2.5))
    assert again.exists(keys[:1]) == [True] and again.usage()["bytes"] == disk.usage()["bytes"]


# ---- Redis down and back -----------------------------------------------------------------------
def test_redis_killed_and_restarted(pools: list[TieredKVPool], own_redis: RedisServer) -> None:
    tier = RedisTier(own_redis.url, retry_s=0.2)
    pool = _pool(pools, [tier])
    hashes, _ = _fill(pool, 3)
    assert pool.lookup(hashes) == 3
    own_redis.kill()
    # Every call returns at once with "nothing here" (the caller recomputes), counted; after
    # the first failure the callers' reads do not even try (only the writer probes).
    assert pool.lookup(hashes) == 0 and pool.get(hashes, _later()) == []
    assert tier.stats.skipped >= 1
    later, _ = _fill(pool, 2, seed=7)  # written nowhere; the writer does not hang either
    assert pool.lookup(later) == 0
    assert tier.stats.errors >= 1 and not tier.up
    assert _sample(pool, "pdserve_kvpool_up", "redis") == 0
    own_redis.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + 10.0
    while not tier.up and time.monotonic() < deadline:  # the writer's housekeeping probes it
        time.sleep(0.05)
    assert tier.up
    again, kvs = _fill(pool, 2, seed=8)
    assert pool.lookup(again) == 2
    assert all(torch.equal(a, b) for a, b in zip(pool.get(again, _later()), kvs, strict=True))


def test_redis_unreachable_from_the_start_is_not_fatal(pools: list[TieredKVPool]) -> None:
    port = RedisServer().port  # free: nobody listens there
    tier = RedisTier(f"redis://127.0.0.1:{port}/0", retry_s=60.0)
    pool = _pool(pools, [MemoryTier(64 * MB), tier])
    hashes, _ = _fill(pool, 2)
    assert pool.lookup(hashes) == 2  # the memory tier works
    assert tier.stats.errors == 1 and tier.stats.skipped > 0


def test_redis_that_never_answers_costs_one_timeout(pools: list[TieredKVPool]) -> None:
    """A server that accepts connections and says nothing (a hung host): the socket timeout
    ends the first call, then the breaker answers callers without touching the network."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes handshakes; nobody ever replies
        tier = RedisTier(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", timeout_s=0.1)
        assert not tier.up and tier.stats.errors == 1  # the first INFO timed out
        pool = _pool(pools, [tier])
        hashes, _ = _fill(pool, 2)
        assert pool.lookup(hashes) == 0 and pool.get(hashes, _later()) == []
        assert tier.stats.skipped >= 2
        pool.close()


def test_bad_redis_url_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="kv-pool-redis"):
        RedisTier("http://localhost:6379")


def test_redis_over_maxmemory_evicts_and_the_pool_serves_shorter_runs(
    pools: list[TieredKVPool],
) -> None:
    server = RedisServer(maxmemory="2mb")
    server.start()
    try:
        tier = RedisTier(server.url)
        pool = _pool(pools, [tier], queue_size=512)
        hashes, kvs = _fill(pool, 200)  # ~3.3 MB of values into 2 MB
        tier.refresh()
        assert int(tier.usage()["server_evicted_keys"]) > 0  # type: ignore[call-overload]
        assert tier.stats.errors == 0 and tier.stats.puts == 200
        n = pool.lookup(hashes)
        got = pool.get(hashes, _later())
        assert len(got) <= n < 200  # LRU dropped some: a shorter run, never a wrong block
        assert all(torch.equal(a, b) for a, b in zip(got, kvs, strict=False))
        pool.close()
    finally:
        server.kill()
        shutil.rmtree(server.workdir, ignore_errors=True)


def test_redis_server_bounds_itself(redis_url: str) -> None:
    """The fixture runs Redis as the pool expects it: LRU under maxmemory, no persistence."""
    with redis.Redis.from_url(redis_url) as client:
        config = client.config_get("*")
    assert config["maxmemory-policy"] == "allkeys-lru" and int(config["maxmemory"]) > 0
    assert config["save"] == "" and config["appendonly"] == "no"


def test_registry_is_reusable_after_close(pools: list[TieredKVPool]) -> None:
    registry = CollectorRegistry()
    first = TieredKVPool(namespace(), [MemoryTier(MB)], registry=registry)
    first.close()
    second = _pool(pools, [MemoryTier(MB)], registry=registry)
    assert second.registry is registry
