"""The paged KV tensors: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim].

Block ids handed out by `KVCacheManager` index the first axis. Token t of a request lives at
block_table[t // block_size], offset t % block_size — the same on every layer.
"""

from __future__ import annotations

import torch

from pdserve.engine.models.arch import ModelArch


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


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def num_blocks_for_memory(
    arch: ModelArch, block_size: int, dtype: torch.dtype, memory_gb: float
) -> int:
    return max(1, int(memory_gb * 1024**3) // bytes_per_block(arch, block_size, dtype))


class PagedKVCache:
    def __init__(
        self,
        arch: ModelArch,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        # Zero-filled so padded (masked) slots never hold NaN/Inf that could leak through 0 * x.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(arch.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
