"""Tiered KV pool (issue 15): host memory, local disk and Redis, keyed by chained block hashes.

`build_pool(config, namespace, registry)` is what workers call: None when no tier is configured,
else a `TieredKVPool` over the configured tiers, fastest first (memory, disk, redis).

Chunking: every tier stores values of up to C consecutive blocks of one chain, aligned on
multiples of C and keyed by the chunk's last block (api.py). C is the whole number of blocks
nearest `--kv-pool-chunk-mb` (default 2 MiB) of stored value: the default model's block
(SmolLM2: 30 layers x 2 x 16 tokens x 3 heads x 64 dims x 4 B = 720 KiB in float32) makes
C = 3, ~2.1 MB per value, inside the 1-10 MB where Redis and files are efficient (int8: C = 11).
`KVPool.put` takes a chunk with its chain position; the engine (engine/pool_link.py) puts one
when it fills and a partial one when its request ends. Lookups stay one round trip per tier
however many blocks they ask about (a dict walk, an index walk, one Redis pipeline of EXISTS
over every candidate chunk end).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pdserve.kvpool.api import BlockHash, FakeKVPool, KVPool, KVPoolConfig, PoolNamespace
from pdserve.kvpool.disk import DiskTier
from pdserve.kvpool.pool import TieredKVPool
from pdserve.kvpool.tiers import MemoryTier, Tier

GB = 1 << 30
DEFAULT_DISK_GB = 10.0

__all__ = [
    "BlockHash",
    "FakeKVPool",
    "KVPool",
    "KVPoolConfig",
    "PoolNamespace",
    "TieredKVPool",
    "build_pool",
]


def build_tiers(config: KVPoolConfig) -> list[Tier]:
    """The configured tiers, fastest first. The disk tier's cap is `disk_gb`, or
    DEFAULT_DISK_GB when only its directory is given."""
    tiers: list[Tier] = []
    if config.memory_gb > 0:
        tiers.append(MemoryTier(int(config.memory_gb * GB)))
    if config.disk_dir is not None:
        disk_gb = config.disk_gb if config.disk_gb > 0 else DEFAULT_DISK_GB
        tiers.append(DiskTier(config.disk_dir, int(disk_gb * GB)))
    if config.redis_url is not None:
        from pdserve.kvpool.redis_tier import RedisTier  # the redis client only when used

        tiers.append(RedisTier(config.redis_url))
    return tiers


def build_pool(
    config: KVPoolConfig, namespace: PoolNamespace, registry: CollectorRegistry | None = None
) -> KVPool | None:
    """The pool `config` asks for, or None when every tier is off. Its `pdserve_kvpool_*`
    metrics go to `registry` (a new one when None: `pool.registry`)."""
    if not config.enabled:
        return None
    return TieredKVPool(namespace, build_tiers(config), registry=registry)
