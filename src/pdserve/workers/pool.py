"""A worker's KV pool: its namespace (what must match for two workers to share entries) and
how it is built from the `--kv-pool-*` flags (the tiers live in kvpool/; engine/pool_link.py
is how the engine uses the pool).

The namespace: the model's fingerprint (weight files' sizes and first and last MiB, plus the
weight quantization, which changes the KV), the KV dtype, the cache's `KVLayout` fingerprint
(layers, KV heads, head dim, dtype), the block size, the codec the values are stored with and
the chunk size (blocks per stored value: the whole number nearest `--kv-pool-chunk-mb` of stored
bytes, kvpool/api.py `chunk_blocks_for`). An engine with two KV groups derives a namespace per
group from it (engine/pool_link.py); the worker names its pools by the global group's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from pdserve.config import WorkerConfig
from pdserve.engine import quantize
from pdserve.engine.engine import LLMEngine
from pdserve.engine.loader import ModelSource
from pdserve.kvpool import build_pool
from pdserve.kvpool.api import DEFAULT_CHUNK_MB, KVPool, KVPoolConfig, PoolNamespace

PoolFactory = Callable[[KVPoolConfig, PoolNamespace], "KVPool | None"]
_SAMPLE = 1 << 20  # bytes read from each end of a weight file


def pool_config(cfg: WorkerConfig) -> KVPoolConfig:
    return KVPoolConfig(
        memory_gb=cfg.kv_pool_memory_gb,
        disk_dir=cfg.kv_pool_disk,
        disk_gb=cfg.kv_pool_disk_gb,
        redis_url=cfg.kv_pool_redis,
        chunk_mb=cfg.kv_pool_chunk_mb,
    )


def model_fingerprint(source: ModelSource, quantization: str = "none") -> str:
    """Equal for the same weights wherever they are stored (a copy at another path, on another
    host), different for other weights: sizes and both ends of every weight file."""
    h = hashlib.sha256()
    weights = (".safetensors", ".json")  # safetensors shards, config.json
    files = (
        [source.path]
        if source.kind == "gguf"
        else sorted(p for p in source.path.iterdir() if p.name.endswith(weights))
    )
    for path in files:
        h.update(_file_sample(path))
    return f"{source.kind}:{h.hexdigest()[:32]}:q={quantization}"


# Quantizations that run a model's weights as its files store them (a GGUF file's blocks, on
# float or integer activations, or dequantized exactly; an HF folder's floats): their KV pair,
# and so does the prefill format's bfloat16 rounding of the same weights. int8, w8g32 and w8a8
# requantize, so their KV is another model's.
AS_STORED = ("none", "gguf", "gguf-a8", "gguf-a16")


def kv_weights(source: ModelSource, quantization: str, architecture: str) -> tuple[str, str]:
    """(what the KV fingerprint covers, a line saying it): the weights whose KV may pair, the
    architecture that reads them and the formats they are stored in (a GGUF file's block
    formats; an HF folder's safetensors)."""
    family = "as stored" if quantization in AS_STORED else f"requantized {quantization}"
    stored = (
        "GGUF " + "+".join(sorted(quantize.gguf_weight_types(source)))
        if source.kind == "gguf"
        else "safetensors"
    )
    named = f"{source.path.name} ({architecture}, {stored}, {family})"
    return f"{model_fingerprint(source, family)} arch={architecture}", named


def kv_fingerprint(engine: LLMEngine) -> tuple[bytes, str]:
    """The KV hand-off's fingerprint of this engine (its `kv_layout`, the weights named by
    `kv_weights`) and its description: which formats this engine runs, for the router's
    refusal to pair workers whose fingerprints differ."""
    layout = engine.kv_layout
    weights, named = kv_weights(engine.source, engine.quantization, engine.arch.architecture)
    prefill = engine.prefill_choice.format
    desc = (
        f"{named}, decode {engine.quantization}, prefill "
        f"{prefill if prefill != 'none' else engine.quantization}, KV {layout.dtype_name} "
        f"{layout.num_layers} layers x {layout.num_kv_heads} heads x {layout.head_dim}"
    )
    return replace(layout, weights=weights).fingerprint(), desc


def _file_sample(path: Path) -> bytes:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(_SAMPLE)
        f.seek(max(0, size - _SAMPLE))
        tail = f.read(_SAMPLE)
    return f"{path.name}|{size}|".encode() + hashlib.sha256(head + tail).digest()


def namespace(
    engine: LLMEngine, codec: str = "none", chunk_mb: float = DEFAULT_CHUNK_MB
) -> PoolNamespace:
    layout = engine.cache.layout  # blocks are stored as cached: --kv-cache-dtype
    model = model_fingerprint(engine.source, engine.quantization)
    return PoolNamespace.of(model, layout, engine.cache.block_size, codec, chunk_mb)


def default_factory(config: KVPoolConfig, ns: PoolNamespace) -> KVPool | None:
    """The pool's tiers from kvpool/ (memory, disk, Redis: whichever the flags name)."""
    return build_pool(config, ns)


def attach(
    engine: LLMEngine, cfg: WorkerConfig, factory: PoolFactory | None = None
) -> KVPool | None:
    """Build the pool the flags ask for (none without them) and attach it to the engine."""
    config = pool_config(cfg)
    if not config.enabled and factory is None:
        return None
    pool = (factory or default_factory)(config, namespace(engine, chunk_mb=config.chunk_mb))
    if pool is not None:
        engine.attach_pool(pool)
    return pool


def pool_ids(cfg: WorkerConfig, ns: PoolNamespace, worker_id: str) -> list[str]:
    # only called for a worker that has a pool
    """Names of the pools this worker reads and writes, for the router's pool index: the
    memory tier is the worker's own, the disk tier is shared by a host's workers naming the
    same folder, the Redis tier by everyone naming the same server."""
    digest = ns.digest().hex()
    ids = []
    if cfg.kv_pool_memory_gb > 0:
        ids.append(f"{digest}|memory|{worker_id}")
    if cfg.kv_pool_disk is not None:
        ids.append(f"{digest}|disk|{Path(cfg.kv_pool_disk).resolve()}")
    if cfg.kv_pool_redis is not None:
        ids.append(f"{digest}|redis|{cfg.kv_pool_redis}")
    return ids or [f"{digest}|custom"]  # a pool from a factory (tests): one per namespace
