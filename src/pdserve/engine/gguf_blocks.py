"""GGUF block formats read as (codes, scales, minimums): what the quantized kernels run.

Every format pdserve runs as the file stores it is, per sub-block of `sub` inputs, `w = scale *
code (+ minimum)` with small integer codes. ggml's block layouts (llama.cpp `ggml-common.h`)
are decoded here the way the `gguf` package's `dequantize_blocks` decodes them, stopping before
the final multiply, so `dequantize(decode(...))` equals `gguf.quants.dequantize` bit for bit
(tests/engine/test_gguf_blocks.py): the scale products (a K-quant's fp16 super-block scale
times its 6- or 8-bit sub-block scale) are formed in float32 as there, where they are exact.

- Q4_0: 32 inputs, fp16 d, codes 0..15: w = d * (q - 8)          -> codes q - 8, no minimum
- Q4_1: 32, fp16 d and m, codes 0..15: w = d * q + m
- Q5_0: 32, fp16 d, 5-bit codes: w = d * (q - 16)
- Q5_1: 32, fp16 d and m, 5-bit codes: w = d * q + m
- Q8_0: 32, fp16 d, int8 codes: w = d * q
- Q4_K / Q5_K: 256 in 8 sub-blocks of 32, fp16 d and dmin, 6-bit (sc, mn) per sub-block:
  w = (d * sc) * q - (dmin * mn), 4- or 5-bit codes
- Q6_K: 256 in 16 sub-blocks of 16, fp16 d, int8 sc per sub-block, 6-bit codes:
  w = (d * sc) * (q - 32)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.quants import Q4_K

QK_K = 256
# Bytes per block and inputs per block, by format (ggml's block_* structs).
BLOCK = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q8_0": (34, 32),
    "Q4_K": (144, QK_K),
    "Q5_K": (176, QK_K),
    "Q6_K": (210, QK_K),
}
FORMATS = tuple(BLOCK)
# Formats whose codes fit 4 bits (0..15) with a minimum: Q4_1's nibble tiles run them.
NIBBLE_FORMATS = ("Q4_0", "Q4_1", "Q4_K")


@dataclass(frozen=True)
class Blocks:
    """Rows [N, K] of one weight: `codes` int8 [N, K]; `scale` float32 [N, K / sub];
    `minimum` float32 [N, K / sub] or None; `sub` inputs share a scale (16 or 32)."""

    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None
    sub: int

    def dequantize(self) -> np.ndarray:
        """float32 [N, K] in the gguf package's order of operations."""
        n, k = self.codes.shape
        q = self.codes.reshape(n, k // self.sub, self.sub).astype(np.float32)
        w = self.scale[:, :, None] * q
        if self.minimum is not None:
            w = w + self.minimum[:, :, None]
        return w.reshape(n, k)


def decode(qtype: str, raw: np.ndarray) -> Blocks:
    """Rows [N, bytes] of `qtype` blocks -> Blocks; ValueError for another format or a row that
    is not whole blocks."""
    if qtype not in BLOCK:
        raise ValueError(f"GGUF block format {qtype} has no decoder here (formats: {FORMATS})")
    size, per = BLOCK[qtype]
    n, width = raw.shape
    if width % size:
        raise ValueError(f"{qtype} rows of {width} bytes are not whole {size}-byte blocks")
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    codes, scale, minimum, sub = _DECODERS[qtype](blocks)
    k = width // size * per
    return Blocks(
        codes.reshape(n, k).astype(np.int8),
        scale.reshape(n, k // sub).astype(np.float32),
        None if minimum is None else minimum.reshape(n, k // sub).astype(np.float32),
        sub,
    )


def _f16(a: np.ndarray) -> np.ndarray:
    return a.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int) -> np.ndarray:
    """[B, 16] bytes -> [B, 32] codes: byte j's low nibble is input j, its high one j + 16."""
    q = qs.reshape(n, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, 32)


def _fifth_bit(qh: np.ndarray, n: int) -> np.ndarray:
    """[B, 4] bytes (a little-endian uint32) -> [B, 32] bit i of the word, as the 5th bit."""
    word = qh.copy().view(np.uint32).reshape(n, 1)
    bits = word >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    n = b.shape[0]
    return _nibbles(b[:, 2:], n).astype(np.int8) - np.int8(8), _f16(b[:, :2]), None, 32


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    n = b.shape[0]
    return _nibbles(b[:, 4:], n), _f16(b[:, :2]), _f16(b[:, 2:4]), 32


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    n = b.shape[0]
    q = _nibbles(b[:, 6:], n) | (_fifth_bit(b[:, 2:6], n) << np.uint8(4))
    return q.astype(np.int8) - np.int8(16), _f16(b[:, :2]), None, 32


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    n = b.shape[0]
    q = _nibbles(b[:, 8:], n) | (_fifth_bit(b[:, 4:8], n) << np.uint8(4))
    return q, _f16(b[:, :2]), _f16(b[:, 2:4]), 32


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    return b[:, 2:].copy().view(np.int8), _f16(b[:, :2]), None, 32


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (d * sc, -(dmin * mn)) float32 [B, 8], as gguf forms them."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = Q4_K.get_scale_min(b[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    n = b.shape[0]
    scale, minimum = _k_scales(b)
    # 4 chunks of 32 bytes: a chunk's low nibbles are sub-block 2c, its high ones 2c + 1
    qs = b[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(n, QK_K), scale, minimum, 32


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    n = b.shape[0]
    scale, minimum = _k_scales(b)
    ql = b[:, 48:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(n, 8, 32)
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    qh = (qh & np.uint8(0x01)).reshape(n, 8, 32)
    return (ql | (qh << np.uint8(4))).reshape(n, QK_K), scale, minimum, 32


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, int]:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    scale = _f16(b[:, 208:210]) * sc
    lo = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    lo = (lo & np.uint8(0x0F)).reshape(n, 8, 32)
    hi = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    hi = (hi & np.uint8(0x03)).reshape(n, 8, 32)
    q = (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)
    return q.reshape(n, QK_K), scale, None, 16


_DECODERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
