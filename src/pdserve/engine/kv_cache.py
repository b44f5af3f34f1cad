"""The paged KV tensors: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim].

Block ids handed out by `KVCacheManager` index the first axis. Token t of a request lives at
block_table[t // block_size], offset t % block_size. Under a window on every layer, entries of
blocks that left the window hold the null block's id (nothing reads them: every attention path
starts at the window's first block).

KV groups (engine/hybrid_kv.py): a model mixing sliding-window and global layers may hold its
sliding layers in their own blocks (`sliding_blocks` of them, group 1) with their own block
table, the global layers in the `num_blocks` of group 0 (`layer_group`). Otherwise every layer
is in group 0 and one table serves them all.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from pdserve.engine.models.arch import ModelArch
from pdserve.kv_layout import KVLayout

log = logging.getLogger(__name__)

ALIGN = 64  # bytes: a cache line, and an AVX-512 vector, so block rows never split one


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for `--kv-cache-dtype name`: the model's, or a narrower one under
    float32 (attention widens it back as it reads; a wider cache than the model would only
    round every key twice)."""
    if name == "auto":
        return model_dtype
    dtype = getattr(torch, name)  # config checked the name
    if dtype != model_dtype and model_dtype != torch.float32:
        raise ValueError(
            f"kv_cache_dtype {name} under dtype {str(model_dtype).removeprefix('torch.')}: "
            "a narrower KV cache needs --dtype float32; use --kv-cache-dtype auto"
        )
    return dtype


def num_blocks_for_memory(layout: KVLayout, block_size: int, memory_gb: float) -> int:
    return max(1, int(memory_gb * 1024**3) // layout.block_nbytes(block_size))


def log_window_layout(arch: ModelArch, groups: str = "") -> None:
    """Say at start-up what the paged KV cache does with the model's sliding windows
    (`groups`: how the blocks were split between KV groups, for a mixed model)."""
    sliding = sum(arch.is_sliding(i) for i in range(arch.num_layers))
    if sliding and arch.sliding_window:
        log.info("%s", _window_layout(arch, sliding, groups))


def _window_layout(arch: ModelArch, sliding: int, groups: str) -> str:
    if arch.uniform_window is not None:
        return (
            f"sliding window {arch.sliding_window} on every layer: KV blocks that leave the "
            "window are freed; the hand-off sends each layer its window"
        )
    if not groups:  # build_kv(groups=False): one table for every layer
        return (
            f"sliding window {arch.sliding_window} on {sliding} of {arch.num_layers} layers: "
            "window layers keep full KV (one block table for all layers); the hand-off sends "
            "window layers only their window"
        )
    return (
        f"sliding window {arch.sliding_window} on {sliding} of {arch.num_layers} layers: two KV "
        f"groups, {groups}; blocks that leave the window are freed in the sliding group; the "
        "hand-off sends window layers only their window"
    )


class PagedKVCache:
    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        sliding_blocks: int | None = None,
    ) -> None:
        """`sliding_blocks`: the sliding layers' own blocks (group 1; layout.layer_kinds says
        which layers slide); None: one group."""
        self.layout = layout  # its dtype is the cache's (--kv-cache-dtype)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, layout.dtype
        kinds = layout.layer_kinds if sliding_blocks is not None else ""
        self.layer_group = [int(kinds[i] == "s") if kinds else 0 for i in range(layout.num_layers)]
        self.group_blocks = [num_blocks] if not kinds else [num_blocks, sliding_blocks or 0]
        # Zero-filled so padded (masked) slots never hold NaN/Inf that could leak through 0 * x.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self._zeros(group, device), self._zeros(group, device)) for group in self.layer_group
        ]

    def _zeros(self, group: int, device: torch.device) -> torch.Tensor:
        layout = self.layout
        shape = (self.group_blocks[group], self.block_size, layout.num_kv_heads, layout.head_dim)
        return zeros(shape, layout.dtype, device)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def slots(self, block_ids: list[int], token_start: int, token_end: int) -> torch.Tensor:
        """Flat slot index of each token in [token_start, token_end) of a block table."""
        bs = self.block_size
        pos = torch.arange(token_start, token_end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def write(self, slots: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [n, KVH, D] into those slots of `layer`, touching no other slot."""
        k_cache, v_cache = self.layers[layer]
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, kvh, d).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, kvh, d).index_copy_(0, slots, v.to(v_cache.dtype))

    def read(self, slots: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [n, KVH, D] of those slots of `layer`, in the cache's dtype."""
        k_cache, v_cache = self.layers[layer]
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        return k_cache.view(-1, kvh, d)[slots], v_cache.view(-1, kvh, d)[slots]

    def copy_block(self, src: int, dst: int, group: int = 0) -> None:
        """Block `dst` of every layer of KV group `group` becomes a copy of block `src`."""
        for (k_cache, v_cache), g in zip(self.layers, self.layer_group, strict=True):
            if g == group:
                k_cache[dst].copy_(k_cache[src])
                v_cache[dst].copy_(v_cache[src])


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose CPU memory becomes resident only as it is written.

    torch.zeros memsets the whole reservation, so every worker's default 1 GiB KV cache is
    resident from start-up, used or not (a P and a D worker of the default model held 2.9 GB
    each; test runs with several servers on one machine came close to the OOM killer). numpy's
    zeros is calloc: fresh pages the kernel maps as zeros on first touch. The same zeros, the
    same reservation; resident memory now grows with the KV actually written. Aligned to
    ALIGN bytes by hand (calloc gives 16)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)
