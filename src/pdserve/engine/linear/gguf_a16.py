"""GGUF projections beyond Q4_1 / Q8_0 under `gguf-a16`: the K-quants (Q4_K, Q5_K, Q6_K, the
formats of the Q4_K_M and Q5_K_M files most people download) and Q4_0, Q5_0, Q5_1, each run
with the file's own codes and scales (gguf_blocks), never re-rounded:

- 4-bit formats (Q4_0, Q4_K, and Q4_1 fused with them) on Q4_1's nibble tiles (kernels/w8a8.cpp
  matmul_q4_1_a16) with float32 scales and minimums: w = d * q + m per 32 inputs, Q4_0 as
  d * q + (-8 d). 0.5 bytes a code, as Q4_1.
- everything else (Q6_K's 16-input sub-blocks, 5-bit codes, and a fused projection whose parts
  mix formats, as a Q4_K_M file's Q4_K q|k with a Q6_K v) on int8 codes with float32 scales per
  16 inputs and minimums per 32 (matmul_k_a16): one byte a code. Q5 codes would fit 5 bits;
  the byte costs decode bandwidth on those tensors (a Q4_K_M file holds few), not accuracy.

Both multiply the codes as integers against int16 activations (one scale per 32 inputs per row,
gguf-a16's), so a K-quant file runs at Q4_1's speed class instead of as float32.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from pdserve.engine import gguf_blocks
from pdserve.engine.gguf_blocks import Blocks
from pdserve.engine.linear import w8a8
from pdserve.engine.linear.base import RowsLinear

log = logging.getLogger(__name__)

TILE = 16  # output channels per kernel tile
GROUP = 32  # inputs per activation scale (and per minimum)
# Block formats this module runs (gguf-a16); Q4_1 / Q8_0 alone keep their own linears.
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


class _Part(Protocol):
    """One file tensor (gguf.GgufWeight; a Protocol, as gguf.py imports this module): its block
    format and raw rows."""

    @property
    def qtype(self) -> str: ...

    @property
    def raw(self) -> np.ndarray: ...


def _pad_rows(a: np.ndarray) -> np.ndarray:
    """[N, ...] -> [Np, ...], Np whole tiles of 16 output channels, zero weights."""
    pad = -(-a.shape[0] // TILE) * TILE - a.shape[0]
    return np.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)) if pad else a


def _tiles(a: np.ndarray) -> torch.Tensor:
    """[Np, G] per-channel values -> [T, G, 16] (a tile's 16 channels side by side)."""
    t, g = a.shape[0] // TILE, a.shape[1]
    return torch.from_numpy(np.ascontiguousarray(a.reshape(t, TILE, g).transpose(0, 2, 1)))


class NibbleA16Linear(RowsLinear):
    """4-bit codes with a float32 scale and minimum per 32 inputs (Q4_0, Q4_1, Q4_K) on
    matmul_q4_1_a16's nibble tiles (the Q4_1 layout: gguf.pack_q4_1_a8)."""

    label = "nibble tiles with float32 scales (Q4_0, Q4_K)"

    def __init__(
        self, blocks: Sequence[Blocks], bias: torch.Tensor | None = None, isa: str | None = None
    ) -> None:
        self._ops = w8a8.kernel(isa)
        codes = np.concatenate([_nibbles(b)[0] for b in blocks])
        d = np.concatenate([_nibbles(b)[1] for b in blocks])
        m = np.concatenate([_nibbles(b)[2] for b in blocks])
        self.out_features, self.in_features = codes.shape
        codes, d, m = _pad_rows(codes.astype(np.uint8)), _pad_rows(d), _pad_rows(m)
        t, g = codes.shape[0] // TILE, self.in_features // GROUP
        c = codes.reshape(t, TILE, g, 2, 4, 4)  # [T, channel, block, half, line, byte]
        packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4)
        self.q = torch.from_numpy(np.ascontiguousarray(packed))
        self.d, self.m = _tiles(d), _tiles(m)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        extra = 0 if self.bias is None else self.bias.nbytes
        self._nbytes = self.q.nbytes + self.d.nbytes + self.m.nbytes + extra

    def dequantized(self) -> torch.Tensor:
        """The float32 [in, out] weight the kernel computes with (tests)."""
        t, g = self.q.shape[:2]
        lo, hi = (self.q & 0x0F).long(), (self.q >> 4).long()
        codes = torch.stack([lo, hi], dim=2).permute(0, 1, 2, 3, 5, 4).reshape(t, g * GROUP, TILE)
        d = self.d.repeat_interleave(GROUP, dim=1)
        m = self.m.repeat_interleave(GROUP, dim=1)
        w = d * codes.float() + m
        return w.permute(1, 0, 2).reshape(self.in_features, -1)[:, : self.out_features]

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self._ops.matmul_q4_1_a16(
            x, self.q, self.d, self.m, self.out_features, self.bias, residual
        )


def _nibbles(b: Blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 4-bit format as (codes 0..15, d, m) per 32 inputs; Q4_0's signed codes shifted by 8."""
    if b.sub != GROUP:
        raise ValueError(f"nibble tiles take 32-input blocks, got {b.sub}")
    if b.minimum is None:  # Q4_0: d * (q - 8) = d * q + (-8 d)
        return b.codes.astype(np.int16) + 8, b.scale, -8 * b.scale
    return b.codes, b.scale, b.minimum


class CodesA16Linear(RowsLinear):
    """int8 codes, a float32 scale per 16 inputs and optionally a float32 minimum per 32
    (matmul_k_a16): any block format here, and fused parts that mix formats."""

    label = "int8 codes, a byte a code (Q5_x, Q6_K, mixed formats)"

    def __init__(
        self, blocks: Sequence[Blocks], bias: torch.Tensor | None = None, isa: str | None = None
    ) -> None:
        self._ops = w8a8.kernel(isa)
        codes = np.concatenate([b.codes for b in blocks])
        self.out_features, self.in_features = codes.shape
        scale = np.concatenate([_per16(b) for b in blocks])
        with_min = any(b.minimum is not None for b in blocks)
        codes, scale = _pad_rows(codes), _pad_rows(scale)
        t, k = codes.shape[0] // TILE, self.in_features
        quads = codes.reshape(t, TILE, k // 4, 4).transpose(0, 2, 1, 3)  # [T, K/4, 16, 4]
        self.q = torch.from_numpy(np.ascontiguousarray(quads.astype(np.int8)))
        s = scale.reshape(t, TILE, k // GROUP, 2).transpose(0, 2, 3, 1)  # [T, G, 2, 16]
        self.s = torch.from_numpy(np.ascontiguousarray(s))
        self.mn: torch.Tensor | None = None
        if with_min:
            self.mn = _tiles(_pad_rows(np.concatenate([_minimum(b) for b in blocks])))
        self.bias = None if bias is None else bias.detach().float().contiguous()
        packed = [self.q, self.s] + [p for p in (self.mn, self.bias) if p is not None]
        self._nbytes = sum(p.nbytes for p in packed)

    def dequantized(self) -> torch.Tensor:
        """The float32 [in, out] weight the kernel computes with (tests)."""
        t, k = self.q.shape[0], self.in_features
        q = self.q.permute(0, 1, 3, 2).reshape(t, k, TILE).float()  # [T, K, 16]
        s = self.s.reshape(t, k // 16, TILE).repeat_interleave(16, dim=1)
        w = s * q
        if self.mn is not None:
            w = w + self.mn.repeat_interleave(GROUP, dim=1)
        return w.permute(1, 0, 2).reshape(k, -1)[:, : self.out_features]

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self._ops.matmul_k_a16(
            x, self.q, self.s, self.mn, self.out_features, self.bias, residual
        )


def _per16(b: Blocks) -> np.ndarray:
    return b.scale if b.sub == 16 else np.repeat(b.scale, b.sub // 16, axis=1)


def _minimum(b: Blocks) -> np.ndarray:
    n, k = b.codes.shape
    if b.minimum is None:
        return np.zeros((n, k // GROUP), np.float32)
    if b.sub != GROUP:
        raise ValueError(f"minimums per {b.sub} inputs have no kernel here")
    return b.minimum


def projection(
    parts: Sequence[_Part], bias: torch.Tensor | None, what: str, isa: str | None = None
) -> RowsLinear:
    """The gguf-a16 stand-in for `parts` (one projection's file tensors, fused in order)."""
    kinds = sorted({p.qtype for p in parts})
    unknown = [k for k in kinds if k not in FORMATS]
    if unknown:
        raise ValueError(
            f"{what} is {', '.join(unknown)}, which pdserve has no kernel for (it runs "
            f"{', '.join(FORMATS)} and float tensors)"
        )
    blocks = [gguf_blocks.decode(p.qtype, p.raw) for p in parts]
    if all(k in gguf_blocks.NIBBLE_FORMATS for k in kinds):
        return NibbleA16Linear(blocks, bias, isa)
    return CodesA16Linear(blocks, bias, isa)
