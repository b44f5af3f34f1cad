"""Small factories shared by the pool's tests: namespaces, block chains and their KV."""

from __future__ import annotations

import threading

import torch

from pdserve.engine.block_pool import hash_full_blocks
from pdserve.kvpool import KVPool, PoolNamespace

BLOCK = 16
SHAPE = (2, 2, BLOCK, 2, 8)  # [layers, K|V, block_size, kv_heads, head_dim]


def namespace(model: str = "tiny-a", codec: str = "none", chunk_blocks: int = 1) -> PoolNamespace:
    return PoolNamespace(
        model=model,
        dtype="float32",
        layout="00ff",
        block_size=BLOCK,
        codec=codec,
        chunk_blocks=chunk_blocks,
    )


def put_chain(pool: KVPool, hashes: list[bytes], kvs: list[torch.Tensor], start: int = 0) -> bool:
    """Put blocks start.. of a chain as the engine does: its chunks, the last one partial when
    the chain ends inside one (`start` a multiple of C). True when every put was accepted."""
    c = pool.namespace.chunk_blocks
    ok = True
    for p in range(start, len(hashes), c):
        ok = pool.put(p, hashes[p : p + c], kvs[p : p + c]) and ok
    return ok


def chain(n: int, seed: int = 0) -> list[bytes]:
    """The chained hashes of n full blocks of a prompt."""
    tokens = [(seed * 7919 + i) % 49152 for i in range(n * BLOCK)]
    return hash_full_blocks(tokens, BLOCK)


def blocks(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) for _ in range(n)]


def kvpool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvpool")]
