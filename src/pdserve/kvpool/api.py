"""The KV pool's interface, shared by its tiers (kvpool/) and its users (workers, router).

A pool stores the KV of *full* engine blocks, keyed by the engine's chained block hash
(`engine.block_pool.hash_full_blocks`) inside a `PoolNamespace`: two instances of the same model,
dtype, KV layout, block size and codec share entries; anything else never collides, because the
namespace's digest prefixes every key in every tier.

One block's KV is a tensor of shape [num_layers, 2, block_size, num_kv_heads, head_dim] (K then V,
layer by layer) in the engine's KV dtype. Tiers may group blocks into chunks internally; callers
only ever see blocks.

Contract every implementation keeps (tests/kvpool/ checks the real tiers and `FakeKVPool` alike):
- `lookup(hashes)` returns how many *leading* hashes are present (across all tiers); it never
  loads data and costs at most one round trip per tier.
- `get(hashes, deadline)` returns the leading run of blocks it could load and verify before the
  monotonic `deadline`; it stops at the first block missing, corrupt or late. A corrupt entry is
  deleted and counted. The caller recomputes whatever was not returned — never wrong tokens.
- `put(hash, kv)` never blocks a step: it enqueues a write-back and returns False (counted as a
  drop) when the queue is full. Entries become visible to `lookup`/`get` only once fully written.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

BlockHash = bytes


@dataclass(frozen=True)
class PoolNamespace:
    """What must match for two workers to share pool entries."""

    model: str  # model fingerprint (e.g. the GGUF file's sha256 or the model path + size)
    dtype: str  # KV dtype, e.g. "float32"
    layout: str  # hex of transfer.wire.layout_fingerprint (layers, kv heads, head dim, dtype)
    block_size: int
    codec: str = "none"  # how values are stored: none | int8

    def digest(self) -> bytes:
        text = f"pdkvpool/1|{self.model}|{self.dtype}|{self.layout}|{self.block_size}|{self.codec}"
        return hashlib.sha256(text.encode()).digest()[:16]

    def key(self, block_hash: BlockHash) -> bytes:
        return self.digest() + block_hash


@dataclass(frozen=True)
class KVPoolConfig:
    """`--kv-pool-*` flags; every tier is off unless its flag is given."""

    memory_gb: float = 0.0
    disk_dir: str | None = None
    disk_gb: float = 0.0
    redis_url: str | None = None

    def __post_init__(self) -> None:
        if self.memory_gb < 0 or self.disk_gb < 0:
            raise ValueError("--kv-pool-memory-gb and --kv-pool-disk-gb must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.memory_gb > 0 or self.disk_dir is not None or self.redis_url is not None


class KVPool(Protocol):
    namespace: PoolNamespace

    def lookup(self, hashes: Sequence[BlockHash]) -> int: ...

    def get(self, hashes: Sequence[BlockHash], deadline: float) -> list[torch.Tensor]: ...

    def put(self, block_hash: BlockHash, kv: torch.Tensor) -> bool: ...

    def stats(self) -> dict[str, object]: ...

    def close(self) -> None: ...


@dataclass
class FakeKVPool:
    """In-process, synchronous, unbounded-by-default pool for tests of the pool's users."""

    namespace: PoolNamespace
    max_blocks: int = 1 << 30
    blocks: OrderedDict[bytes, torch.Tensor] = field(default_factory=OrderedDict)
    puts: int = 0
    drops: int = 0
    gets: int = 0

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if self.namespace.key(h) not in self.blocks:
                break
            n += 1
        return n

    def get(self, hashes: Sequence[BlockHash], deadline: float) -> list[torch.Tensor]:
        self.gets += 1
        out: list[torch.Tensor] = []
        for h in hashes:
            kv = self.blocks.get(self.namespace.key(h))
            if kv is None:
                break
            out.append(kv.clone())
        return out

    def put(self, block_hash: BlockHash, kv: torch.Tensor) -> bool:
        if len(self.blocks) >= self.max_blocks:
            self.drops += 1
            return False
        self.puts += 1
        self.blocks[self.namespace.key(block_hash)] = kv.detach().clone()
        return True

    def stats(self) -> dict[str, object]:
        return {"blocks": len(self.blocks), "puts": self.puts, "drops": self.drops}

    def close(self) -> None:
        self.blocks.clear()
