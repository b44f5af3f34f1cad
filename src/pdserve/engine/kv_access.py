"""The engine's KV as workers reach it: slots of a request's tokens in each layer's KV group,
reads and writes of K/V there (the P -> D hand-off), and the prefix-cache events routers are
told. A base class of `LLMEngine` (engine/engine.py), which owns the cache and its manager."""

from __future__ import annotations

import torch

from pdserve.engine.hybrid_kv import KVManager
from pdserve.engine.kv_cache import PagedKVCache


class KVAccess:
    cache: PagedKVCache
    kv_manager: KVManager
    device: torch.device
    dtype: torch.dtype

    def kv_slots(self, block_ids: list[int], token_start: int, token_end: int) -> torch.Tensor:
        """Flat slot index of each token in [token_start, token_end) of a block table."""
        return self.cache.slots(block_ids, token_start, token_end).to(self.device)

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block table of each KV group (kv_cache.py `layer_group`)."""
        sliding = self.kv_manager.sliding_block_ids(request_id)
        full = self.kv_manager.get_block_ids(request_id)
        return [full] if sliding is None else [full, sliding]

    def layer_slots(self, request_id: str, layer: int, start: int, end: int) -> torch.Tensor:
        """`kv_slots` of the request's tokens [start, end) on `layer` (its group's table)."""
        table = self.block_tables(request_id)[self.cache.layer_group[layer]]
        return self.kv_slots(table, start, end)

    def write_kv(self, slots: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store received K/V [n, KVH, D] into reserved slots. Touches only those slots, so a
        receiver thread may call it while the engine steps on other requests."""
        self.cache.write(slots, layer, k, v)

    def read_kv(self, slots: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [n, KVH, D] of those slots in the model's dtype (what the wire carries, whatever
        either side's --kv-cache-dtype: the layer-streamed KV is the model's activations)."""
        k, v = self.cache.read(slots, layer)
        return k.to(self.dtype), v.to(self.dtype)

    # ---- prefix-cache events (pushed to routers by the worker) -------------------------------
    @property
    def has_kv_events(self) -> bool:
        return self.kv_manager.has_events

    def take_kv_events(self) -> tuple[list[bytes], list[bytes], bool]:
        """(stored, removed, cleared) block hashes since the last call; `cleared`: `stored` is
        the whole current set (the pending buffer overflowed)."""
        return self.kv_manager.take_events()

    def cached_block_hashes(self) -> list[bytes]:
        return self.kv_manager.cached_hashes()
