"""The KV a transfer bench moves and where it lands: random K and V of a model's layout, its
frames (what `PrefillSide` sends per layer), and the receiver's `Store` (what `DecodeSide`
does with a frame: check, decode, copy into a paged cache at block-shuffled slots), timed
stage by stage."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pdserve.bench.transfer.transfer_results import BLOCK_SIZE, SEED, Layout

if TYPE_CHECKING:
    import torch


def minor_faults() -> int:
    """Minor page faults of this thread so far: first touches of freshly allocated memory."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def _torch_dtype(dtype: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _shuffled_slots(n: int, seed: int = SEED) -> torch.Tensor:
    """Slots of tokens [0, n) in a paged cache whose block table is a random permutation."""
    import torch

    blocks = -(-n // BLOCK_SIZE)
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(n)
    return table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def random_kv(layout: Layout, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    shape = (layout.layers, n, layout.kv_heads, layout.head_dim)
    dtype = _torch_dtype(layout.dtype)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def fingerprint(layout: Layout) -> bytes:
    from pdserve.kv_layout import KVLayout

    dtype = _torch_dtype(layout.dtype)
    return KVLayout(layout.layers, layout.kv_heads, layout.head_dim, dtype).fingerprint()


def encode_layers(
    rid: str, keys: torch.Tensor, values: torch.Tensor, codec: str, fp: bytes
) -> list[list[Any]]:
    from pdserve.transfer import wire

    return [
        wire.encode_frame(rid, layer, 0, [keys[layer]], [values[layer]], codec, fp)
        for layer in range(keys.shape[0])
    ]


def setup_msg(layout: Layout, n: int, fp: bytes) -> dict[str, Any]:
    return {
        "op": "setup",
        "tokens": n,
        "layers": layout.layers,
        "kv_heads": layout.kv_heads,
        "head_dim": layout.head_dim,
        "dtype": layout.dtype,
        "fingerprint": fp,
    }


class Store:
    """What `DecodeSide` does with frames: check, decode, copy into a paged cache."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self.fingerprint: bytes | None = None
        self.reset()

    def reset(self) -> None:
        self.frames = self.bad = self.nbytes = self.tensors = self.in_place = 0
        self.first_at: float | None = None
        self.faults_at_first = 0
        self.last_at = 0.0
        self.t_decode_frame = self.t_codec = self.t_store = 0.0

    def setup(self, msg: dict[str, Any]) -> None:
        import torch

        n, dtype = msg["tokens"], _torch_dtype(msg["dtype"])
        self.k = self.v = None  # free the previous size first
        slots = -(-n // BLOCK_SIZE) * BLOCK_SIZE
        shape = (msg["layers"], slots, msg["kv_heads"], msg["head_dim"])
        self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.slots = _shuffled_slots(n)
        self.fingerprint = msg["fingerprint"]
        self.reset()

    def on_frame(self, parts: list[Any]) -> None:
        from pdserve.transfer import wire

        t0 = time.monotonic()
        if self.first_at is None:
            self.first_at, self.faults_at_first = t0, minor_faults()
        try:
            wire.peek_header(parts)
            frame = wire.decode_frame(parts, fingerprint=self.fingerprint)
        except wire.WireError:
            self.bad += 1
            return
        t1 = time.monotonic()
        h = frame.header
        assert self.k is not None and self.v is not None and self.slots is not None
        slots = self.slots[h.token_start : h.token_end]
        layers = frame.layers()
        t_codec = t_store = 0.0
        received = [_address_range(p) for p in parts]
        while True:
            ta = time.monotonic()
            item = next(layers, None)
            tb = time.monotonic()
            if item is None:
                break
            layer, k, v = item
            self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
            self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))
            t_codec += tb - ta
            t_store += time.monotonic() - tb
            self.tensors += 2
            self.in_place += sum(_inside(t.data_ptr(), received) for t in (k, v))
        self.t_decode_frame += t1 - t0
        self.t_codec += t_codec
        self.t_store += t_store
        self.frames += 1
        self.nbytes += h.header_len + h.payload_len
        self.last_at = time.monotonic()

    def report(self) -> dict[str, Any]:
        return {
            "frames": self.frames,
            "bad": self.bad,
            "nbytes": self.nbytes,
            "first_frame_at": self.first_at or 0.0,
            "last_frame_at": self.last_at,
            "decode_frame_s": self.t_decode_frame,
            "codec_decode_s": self.t_codec,
            "store_s": self.t_store,
            "tensors": self.tensors,
            "in_place": self.in_place,
            "minor_faults": minor_faults() - self.faults_at_first if self.first_at else 0,
        }


def _address_range(part: Any) -> tuple[int, int]:
    import numpy as np

    arr = np.frombuffer(part, dtype=np.uint8)
    return arr.ctypes.data, arr.ctypes.data + arr.nbytes


def _inside(ptr: int, ranges: list[tuple[int, int]]) -> bool:
    """Whether a decoded tensor's memory lies in a received buffer (a view, not a copy)."""
    return any(lo <= ptr < hi for lo, hi in ranges)
