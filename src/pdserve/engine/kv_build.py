"""The paged KV cache and its manager for an engine: one KV group, or two for a model mixing
sliding-window and global layers (engine/hybrid_kv.py).

`choose_manager` is the choice and sizing alone, on block ids (no tensors): the engine's
`build_kv` allocates the cache beside it, and the simulator (sim/kv_groups.py) calls it for
its workers, so both hold the same KV groups of the same sizes."""

from __future__ import annotations

import torch

from pdserve.config import EngineConfig
from pdserve.engine import hybrid_kv
from pdserve.engine.hybrid_kv import GroupSizes, HybridKVCacheManager, KVManager
from pdserve.engine.kv_cache import PagedKVCache, log_window_layout
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.models.arch import ModelArch
from pdserve.kv_layout import KVLayout


def choose_manager(
    num_blocks: int,
    block_size: int,
    window: int | None,
    layer_kinds: str,
    *,
    prefix_caching: bool,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    conversation_ttl_s: float = 0.0,
    groups: bool = True,
) -> tuple[KVManager, GroupSizes | None]:
    """The manager for the memory of `num_blocks` blocks of every layer, with the group sizes
    when there are two. `layer_kinds` is "s" (sliding) or "f" (full) per layer, "" when no
    layer slides (`KVLayout.layer_kinds`). A mix of both kinds gets a KV group for each when
    `groups` (sizes from `hybrid_kv.split_blocks`); any other model one manager, windowed when
    every layer slides (it frees the blocks that leave the window)."""
    uniform = window if layer_kinds and "f" not in layer_kinds else None
    if not groups or window is None or "s" not in layer_kinds or uniform is not None:
        kv = KVCacheManager(
            num_blocks, block_size, prefix_caching, window=uniform,
            conversation_ttl_s=conversation_ttl_s,
        )  # fmt: skip
        return kv, None
    size = hybrid_kv.split_blocks(
        num_blocks, len(layer_kinds), layer_kinds.count("s"), window, block_size,
        max_num_seqs, max_num_batched_tokens,
    )  # fmt: skip
    hybrid = HybridKVCacheManager(
        size.full, size.sliding, block_size, window, prefix_caching,
        conversation_ttl_s=conversation_ttl_s,
    )  # fmt: skip
    return hybrid, size


def build_kv(
    arch: ModelArch,
    layout: KVLayout,
    num_blocks: int,
    config: EngineConfig,
    device: torch.device,
    groups: bool = True,
) -> tuple[PagedKVCache, KVManager]:
    """The cache and manager for the memory of `num_blocks` blocks of every layer
    (`choose_manager`: two KV groups for a model mixing sliding and global layers when
    `groups`; a KV pool keeps them, engine/pool_link.py). Says which at start-up."""
    cc, sc = config.cache_config, config.scheduler_config
    bs = cc.block_size
    kv, size = choose_manager(
        num_blocks, bs, layout.window, layout.layer_kinds,
        prefix_caching=cc.enable_prefix_caching, max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        conversation_ttl_s=cc.conversation_ttl, groups=groups,
    )  # fmt: skip
    if size is None:
        log_window_layout(arch)
        return PagedKVCache(layout, num_blocks, bs, device), kv
    log_window_layout(
        arch,
        f"{size.full} blocks of the global layers and {size.sliding} of the sliding ones (the "
        f"memory of {num_blocks} blocks of every layer; running requests hold at most "
        f"{size.steady} sliding blocks: max_num_seqs x (cdiv(window - 1, block) + 2) + "
        "cdiv(max_num_batched_tokens, block), a quarter more for the prefix cache)",
    )
    return PagedKVCache(layout, size.full, bs, device, size.sliding), kv
