"""`KVLayout`: the shape of a model's KV as everything that stores or moves it sees it.

The engine's paged cache is allocated from it (engine/kv_cache.py), the P -> D hand-off checks
every frame against its fingerprint (transfer/wire.py, workers/pool.py `kv_fingerprint`), and the
KV pool names its namespace with it (kvpool/api.py `PoolNamespace.of`). It lives here, at the
bottom of the tree, because those three use it and none may import another for it: the engine
never imports transfer/, and transfer/ never the engine. The engine builds one from its model
(`ModelArch.kv_layout`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

FINGERPRINT_BYTES = 8


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of the KV as stored or sent (the cache's, or the model's on the wire)
    # A sliding window on some layers (`layer_kinds`: "s" sliding or "f" full, per layer);
    # None: every layer sees every key. The window changes the KV of every layer after the first,
    # and the hand-off sends a sliding layer only its window (ModelArch.kv_needed_from).
    window: int | None = None
    layer_kinds: str = ""
    # The weights the KV is computed from (workers/pool.py `kv_weights`), when they must match
    # too: a P and a D whose weights differ must not pair. "" names the layout alone.
    weights: str = ""

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def block_shape(self, block_size: int) -> tuple[int, int, int, int, int]:
        """One block's KV as one tensor: [layers, 2 (K, V), block_size, kv_heads, head_dim]
        (the KV pool's unit, kvpool/api.py)."""
        return (self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim)

    def block_nbytes(self, block_size: int) -> int:
        """Bytes of one block's K and V on every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def fingerprint(self) -> bytes:
        """FINGERPRINT_BYTES of sha256 naming this layout, independent of the model's name: two
        workers serving the same layout agree, and a KV frame (transfer/wire.py) or pool entry of
        another layout is refused. The text is a wire format: changing it unpairs every P and D
        of different versions, so it carries its own version (`pdkv-layout/1`)."""
        text = (
            f"pdkv-layout/1 layers={self.num_layers} kv_heads={self.num_kv_heads} "
            f"head_dim={self.head_dim} dtype={self.dtype_name}"
        )
        if self.window is not None:
            # a build that sent sliding layers whole does not pair with one that expects their
            # window (`window-kv/1`); layouts without a window are unchanged
            text += f" window={self.window} layers={self.layer_kinds} window-kv/1"
        if self.weights:
            text += f" weights={self.weights}"
        return hashlib.sha256(text.encode()).digest()[:FINGERPRINT_BYTES]
