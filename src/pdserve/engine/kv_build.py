"""The paged KV cache and its manager for an engine: one KV group, or two for a model mixing
sliding-window and global layers (engine/hybrid_kv.py)."""

from __future__ import annotations

import torch

from pdserve.config import EngineConfig
from pdserve.engine import hybrid_kv
from pdserve.engine.hybrid_kv import HybridKVCacheManager, KVManager
from pdserve.engine.kv_cache import PagedKVCache, log_window_layout
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.models.arch import ModelArch
from pdserve.kv_layout import KVLayout


def build_kv(
    arch: ModelArch,
    layout: KVLayout,
    num_blocks: int,
    config: EngineConfig,
    device: torch.device,
    groups: bool = True,
) -> tuple[PagedKVCache, KVManager]:
    """The cache and manager for the memory of `num_blocks` blocks of every layer: a model
    mixing sliding and global layers gets a KV group for each kind when `groups` (sizes from
    `hybrid_kv.split_blocks`; a KV pool keeps them, engine/pool_link.py), any other model one
    group (windowed throughout: the manager frees what leaves the window). Says which at
    start-up."""
    cc, sc = config.cache_config, config.scheduler_config
    bs, window = cc.block_size, arch.sliding_window
    if not groups or window is None or layout.window is None or arch.uniform_window:
        kv = KVCacheManager(
            num_blocks, bs, cc.enable_prefix_caching, window=arch.uniform_window,
            conversation_ttl_s=cc.conversation_ttl,
        )  # fmt: skip
        log_window_layout(arch)
        return PagedKVCache(layout, num_blocks, bs, device), kv
    size = hybrid_kv.split_blocks(
        num_blocks, arch.num_layers, layout.layer_kinds.count("s"), window, bs,
        sc.max_num_seqs, sc.max_num_batched_tokens,
    )  # fmt: skip
    log_window_layout(
        arch,
        f"{size.full} blocks of the global layers and {size.sliding} of the sliding ones (the "
        f"memory of {num_blocks} blocks of every layer; running requests hold at most "
        f"{size.steady} sliding blocks: max_num_seqs x (cdiv(window - 1, block) + 2) + "
        "cdiv(max_num_batched_tokens, block), a quarter more for the prefix cache)",
    )
    hybrid = HybridKVCacheManager(
        size.full, size.sliding, bs, window, cc.enable_prefix_caching,
        conversation_ttl_s=cc.conversation_ttl,
    )  # fmt: skip
    return PagedKVCache(layout, size.full, bs, device, size.sliding), hybrid
