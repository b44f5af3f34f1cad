"""The KV pool's interface, shared by its tiers (kvpool/) and its users (workers, router).

A pool stores the KV of *full* engine blocks, keyed by the engine's chained block hash
(`engine.block_pool.hash_full_blocks`) inside a `PoolNamespace`: two instances of the same model,
dtype, KV layout, block size, codec and chunk size share entries; anything else never collides,
because the namespace's digest prefixes every key in every tier. A model with two KV groups
(engine/hybrid_kv.py) stores each group's layers under a namespace naming them
(`PoolNamespace.for_layers`, `KVPool.for_namespace`): the same store, other keys.

One block's KV is a tensor of shape [num_layers, 2, block_size, num_kv_heads, head_dim] (K then V,
layer by layer; a group namespace's layers only) in the engine's KV dtype. Values are *chunks*: up
to C = `chunk_blocks` consecutive full blocks of one chain starting at a block index that is a
multiple of C, stored as one value under the chained hash of the chunk's LAST block. A chained hash
fixes its block's position, so the key implies the chunk's start; a full chunk (C blocks) and a
partial one (a finished request's tail, 1..C-1 blocks) over the same start are separate keys. Chunks
make values of ~2 MiB (default) instead of one block's 0.7 MB, fewer files and Redis keys per
prompt; the price is granularity: a prefix is found in whole stored chunks, so a prompt that shares
only part of a chunk with what was stored recomputes up to C-1 blocks of it. Callers only ever see
blocks.

Contract every implementation keeps (tests/kvpool/ checks the real tiers and `FakeKVPool` alike):
- `hashes[i]` names block `start + i` of its chain: `start` (default 0) is where the caller's
  blocks begin, e.g. after its local prefix cache. Chunk alignment depends on it: a caller that
  passes hashes from block k > 0 MUST pass start=k.
- `lookup(hashes, start)` returns how many *leading* blocks are present (across all tiers): the
  run of chunks where, at each aligned start p, the longest chunk stored over p is taken and
  the run goes on only past a full one (the first chunk may begin before `start`). It never
  loads data and costs at most one round trip per tier.
- `get(hashes, deadline, start)` reads the chunks a run of exactly `len(hashes)` blocks is made
  of (full chunks, then a partial one to the end): pass it `hashes[:lookup(hashes, start)]`. It
  returns the leading run of blocks it could load and verify before the monotonic `deadline`;
  it stops at the first chunk missing, corrupt or late. A corrupt entry is deleted and counted.
  The caller recomputes whatever was not returned - never wrong tokens.
- `put(first, hashes, kvs)` stores one chunk: blocks first..first+len-1 of a chain (`hashes[i]`
  names block first+i), `first` a multiple of C, 1..C blocks. It never blocks a step: it enqueues
  a write-back and returns False (counted as a drop) when the queue is full. Entries become
  visible to `lookup`/`get` only once fully written.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from pdserve.kv_layout import KVLayout
from pdserve.kvpool.values import value_nbytes

BlockHash = bytes

DEFAULT_CHUNK_MB = 2.0  # target stored bytes of a chunk (the issue: 1-10 MB values in Redis)
MAX_CHUNK_BLOCKS = 16  # 256 tokens at block size 16: bounds the prefix granularity lost to chunks


@dataclass(frozen=True)
class PoolNamespace:
    """What must match for two workers to share pool entries."""

    model: str  # model fingerprint (e.g. the GGUF file's sha256 or the model path + size)
    dtype: str  # KV dtype, e.g. "float32"
    layout: str  # hex of KVLayout.fingerprint (layers, kv heads, head dim, dtype)
    block_size: int
    codec: str = "none"  # how values are stored: none | int8
    chunk_blocks: int = 1  # C: blocks per stored value (see the module docstring)
    # The layers a value holds, ascending indices joined by commas: one KV group's
    # (engine/pool_link.py); "" every layer. Part of the digest when set, so a value of some
    # layers is never read as one of all layers, nor of other layers.
    layers: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_blocks <= MAX_CHUNK_BLOCKS:
            raise ValueError(
                f"chunk_blocks must be in [1, {MAX_CHUNK_BLOCKS}], got {self.chunk_blocks}"
            )

    @classmethod
    def of(
        cls,
        model: str,
        layout: KVLayout,
        block_size: int,
        codec: str = "none",
        chunk_mb: float = DEFAULT_CHUNK_MB,
    ) -> PoolNamespace:
        """The namespace of blocks of `layout` (its dtype: as cached, and so as stored) computed
        by the weights `model` names; chunks of about `chunk_mb` MiB stored with `codec`."""
        block = layout.block_shape(block_size)
        block_bytes = value_nbytes(48, block, layout.dtype, codec)  # 48: a pool key's bytes
        return cls(
            model=model,
            dtype=layout.dtype_name,
            layout=layout.fingerprint().hex(),
            block_size=block_size,
            codec=codec,
            chunk_blocks=chunk_blocks_for(chunk_mb, block_bytes),
        )

    def for_layers(self, layers: Sequence[int], chunk_blocks: int) -> PoolNamespace:
        """The namespace of values holding only `layers` (a KV group's) of this namespace's
        blocks, in chunks of `chunk_blocks`."""
        if self.layers:
            raise ValueError(f"namespace of layers {self.layers} has no sub-groups")
        if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0:
            raise ValueError(f"a KV group's layers are ascending indices, got {list(layers)}")
        return replace(self, layers=",".join(map(str, layers)), chunk_blocks=chunk_blocks)

    def digest(self) -> bytes:
        # pdkvpool/2: chunked values (values.py version 2); version-1 keys are never asked for.
        text = (
            f"pdkvpool/2|{self.model}|{self.dtype}|{self.layout}|{self.block_size}|{self.codec}"
            f"|{self.chunk_blocks}"
        )
        if self.layers:  # a KV group's values (pdkvpool-layers/1); every-layer digests unchanged
            text += f"|pdkvpool-layers/1={self.layers}"
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
    chunk_mb: float = DEFAULT_CHUNK_MB

    def __post_init__(self) -> None:
        if self.memory_gb < 0 or self.disk_gb < 0:
            raise ValueError("--kv-pool-memory-gb and --kv-pool-disk-gb must be >= 0")
        if not self.chunk_mb > 0:
            raise ValueError(f"--kv-pool-chunk-mb must be > 0, got {self.chunk_mb}")

    @property
    def enabled(self) -> bool:
        return self.memory_gb > 0 or self.disk_dir is not None or self.redis_url is not None


def chunk_blocks_for(chunk_mb: float, block_value_bytes: int) -> int:
    """C for a target chunk size: the whole number of blocks nearest `chunk_mb` MiB of stored
    value, at least 1 and at most MAX_CHUNK_BLOCKS (default model, float32: 720 KiB a block,
    2 MiB -> 3 blocks)."""
    if block_value_bytes <= 0:
        raise ValueError(f"a block's stored size must be > 0 bytes, got {block_value_bytes}")
    return max(1, min(MAX_CHUNK_BLOCKS, round(chunk_mb * (1 << 20) / block_value_bytes)))


def chunk_spans(start: int, end: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """The chunks [p, e) a run of blocks [start, end) is read from: aligned, full ones, the last
    one ending at `end` (partial when `end` is not aligned); the first one begins at or before
    `start` (its blocks before `start` are read and dropped)."""
    base = start - start % chunk_blocks
    return [(p, min(p + chunk_blocks, end)) for p in range(base, end, chunk_blocks)]


def chunk_run(present: Sequence[bool], start: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """`leading_chunks` for blocks from any `start` (present[i]: a chunk ending at block start+i
    is stored): from the aligned block at or before `start`, whose chunk must reach `start`."""
    base = start - start % chunk_blocks
    return leading_chunks([False] * (start - base) + list(present), base, chunk_blocks)


def leading_chunks(present: Sequence[bool], start: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """The run of chunks [p, end) from the aligned block `start`, where present[i] says whether
    a chunk ending at block start+i is stored: at each aligned p the longest chunk over p, and on
    only past a full one (a partial chunk is a request's tail: nothing after it is known)."""
    if start % chunk_blocks:
        raise ValueError(f"a run starts at a multiple of {chunk_blocks}, not {start}")
    run: list[tuple[int, int]] = []
    p, n = start, start + len(present)
    while p < n:
        hi = min(p + chunk_blocks, n)
        ends = [q for q in range(hi - 1, p - 1, -1) if present[q - start]]
        if not ends:
            break
        run.append((p, ends[0] + 1))
        if ends[0] + 1 - p < chunk_blocks:
            break
        p += chunk_blocks
    return run


class KVPool(Protocol):
    namespace: PoolNamespace

    def lookup(self, hashes: Sequence[BlockHash], start: int = 0) -> int: ...

    def get(
        self, hashes: Sequence[BlockHash], deadline: float, start: int = 0
    ) -> list[torch.Tensor]: ...

    def put(self, first: int, hashes: Sequence[BlockHash], kvs: Sequence[torch.Tensor]) -> bool: ...

    def for_namespace(self, namespace: PoolNamespace) -> KVPool:
        """The same store under `namespace`, one of this namespace's KV groups
        (`PoolNamespace.for_layers`): its own keys, chunk size and block shape; counters,
        write-back and lifetime are this pool's (closing it closes both)."""
        ...

    def stats(self) -> dict[str, object]: ...

    def close(self) -> None: ...


def check_chunk(ns: PoolNamespace, first: int, hashes: Sequence[BlockHash], n_kvs: int) -> None:
    """ValueError unless (first, hashes) is one chunk of `ns`'s layout with a tensor per block."""
    c = ns.chunk_blocks
    if first < 0 or first % c or not 1 <= len(hashes) <= c or len(hashes) != n_kvs:
        raise ValueError(
            f"a pool chunk is 1..{c} blocks from a multiple of {c} with one tensor each; got "
            f"first={first}, {len(hashes)} hashes, {n_kvs} tensors"
        )


def check_group(ns: PoolNamespace, group: PoolNamespace) -> None:
    """ValueError unless `group` is one of `ns`'s KV groups: the same model, KV, block size and
    codec, some of its layers (`KVPool.for_namespace`)."""
    if (
        not group.layers
        or ns.layers
        or replace(group, layers="", chunk_blocks=1) != replace(ns, chunk_blocks=1)
    ):
        raise ValueError(f"{group} is not a KV group of {ns}")


@dataclass
class FakeKVPool:
    """In-process, synchronous, unbounded-by-default pool for tests of the pool's users. It
    stores chunks like the real pool (`blocks`: pool key of a chunk's last block -> its block
    tensors), so callers see the same runs."""

    namespace: PoolNamespace
    max_blocks: int = 1 << 30
    blocks: OrderedDict[bytes, list[torch.Tensor]] = field(default_factory=OrderedDict)
    puts: int = 0  # chunks stored
    put_blocks: int = 0
    drops: int = 0
    gets: int = 0

    def lookup(self, hashes: Sequence[BlockHash], start: int = 0) -> int:
        present = [self.namespace.key(h) in self.blocks for h in hashes]
        run = chunk_run(present, start, self.namespace.chunk_blocks)
        return run[-1][1] - start if run else 0

    def get(
        self, hashes: Sequence[BlockHash], deadline: float, start: int = 0
    ) -> list[torch.Tensor]:
        self.gets += 1
        out: list[torch.Tensor] = []
        for p, end in chunk_spans(start, start + len(hashes), self.namespace.chunk_blocks):
            chunk = self.blocks.get(self.namespace.key(hashes[end - 1 - start]))
            if chunk is None:
                break
            if len(chunk) != end - p:  # a bad entry: returned as is, the caller must check
                out += [kv.clone() for kv in chunk]
                break
            out += [kv.clone() for kv in chunk[max(p, start) - p :]]
        return out

    def put(self, first: int, hashes: Sequence[BlockHash], kvs: Sequence[torch.Tensor]) -> bool:
        check_chunk(self.namespace, first, hashes, len(kvs))
        if self.put_blocks + len(kvs) > self.max_blocks:
            self.drops += 1
            return False
        self.puts += 1
        self.put_blocks += len(kvs)
        self.blocks[self.namespace.key(hashes[-1])] = [kv.detach().clone() for kv in kvs]
        return True

    def for_namespace(self, namespace: PoolNamespace) -> FakeKVPool:
        """A pool over the same `blocks` under a group's namespace (counted apart; a subclass's
        own fields kept)."""
        check_group(self.namespace, namespace)
        return replace(self, namespace=namespace, puts=0, put_blocks=0, drops=0, gets=0)

    def stats(self) -> dict[str, object]:
        return {"chunks": len(self.blocks), "puts": self.puts, "drops": self.drops}

    def close(self) -> None:
        self.blocks.clear()
