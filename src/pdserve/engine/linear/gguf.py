"""`--quantization gguf`: run a GGUF file's own quantized weights, not a re-rounding of them.

The default model ships as Q4_1 (its projections) and Q8_0 (the tied embedding / LM head).
`none` dequantizes the file to float32 and reads 8x its bytes a step; w8g32 and w8a8 round the
dequantized weights a second time (to int8), which is where their disagreement with float32
comes from. Under `gguf` each projection computes with exactly the weights the file holds:
- Q4_1 (per 32 inputs a fp16 scale d, a fp16 minimum m and 4-bit codes: w = d * q + m) runs on
  kernels/q4_1.cpp, 0.625 bytes a weight, float32 activations;
- Q8_0 (per 32 inputs a fp16 scale and int8 codes: w = d * q) *is* w8g32's format: w8g32's
  packing of the dequantized values gets back the same codes and scales (its scale is
  amax / 127, and a Q8_0 block's largest code is +-127), so Q8_0 runs on the w8g32 kernel;
- float tensors (F32 / F16 / BF16) stay float.
The K-quants (Q4_K, Q5_K, Q6_K: Q4_K_M / Q5_K_M files), Q4_0, Q5_0 and Q5_1, and fused
projections whose parts mix formats, run under `gguf-a16` on linear/gguf_a16.py's kernels,
their own codes and scales as stored. Any other block format is refused at start-up with the
tensor named under `gguf*`, and `auto` runs such a file as float32 under a WARNING naming the
formats and the cost: never silently. Only the greedy-parity rule of `none` does not apply:
the sums run in another order than torch's GEMM (quality: docs/benchmarks/quant.md).

`gguf-a8` runs the same weights against int8 activations (one scale per 32 inputs per row, as
llama.cpp's Q8 activations): Q4_1 on kernels/w8a8.cpp's matmul_q4_1 (integer dot products of the
codes), Q8_0 on W8A8Linear, q|k|v on float activations as under w8a8
(quantize.W8A8_FLOAT_ACTIVATIONS). The speed of integer arithmetic where a batch of rows makes the
float kernel compute-bound, for the activations' rounding.

`gguf-a16` runs the same Q4_1 weights against int16 activations (one scale per 32 inputs per
row; kernels/w8a8.cpp's matmul_q4_1_a16), every projection, at every row count (decode and
prefill): the codes are multiplied as integers (vpdpwssd / vpmaddwd) instead of widened to
float one by one, and the rounding (2^-16 of each block's largest input) is below the float16
KV cache's. A Q8_0 tensor (the default model's LM head) runs w8g32's codes and scales against
the same int16 activations (w8a8.W8A16Linear, matmul_a16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch

from pdserve.engine import kernels
from pdserve.engine.linear import gguf_a16, w8a8
from pdserve.engine.linear.base import Projection, RowsLinear, StreamedLinear, float_bias
from pdserve.engine.linear.w8a8 import W8A8Linear, W8A16Linear
from pdserve.engine.linear.w8g32 import W8G32Linear

# GGUF block formats with a kernel here, by the name gguf.GGMLQuantizationType gives them.
Q4_1, Q8_0 = "Q4_1", "Q8_0"
FLOAT_TYPES = ("F32", "F16", "BF16")
Q4_1_BLOCK = 32  # weights per block
Q4_1_BLOCK_BYTES = 20  # d (fp16), m (fp16), 16 bytes of codes (two per byte)
TILE = 16  # output channels per kernel tile (kernels/q4_1.cpp)
# Prefill dequantizes at most this many weights at a time (1 MB of float32) before each GEMM: a
# chunk that stays in L2. Alternated in one process (Xeon, one thread, the default model's
# prompt step): 16 MB chunks (w8g32's) took 1.14x / 1.08x / 1.02x `none`'s time at 128 / 512 /
# 2048 tokens, written out to memory and read back; 1 MB chunks 1.02x / 1.03x / 1.00x.
Q4_1_PREFILL_SCRATCH = 1 << 18


@dataclass(frozen=True)
class GgufWeight:
    """One weight matrix as the file stores it: `raw` [output channels, bytes per row] of
    `qtype` blocks (Q/K rows already in HF order)."""

    qtype: str
    raw: np.ndarray


def unpack_q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 rows [N, G * 20] (ggml's block_q4_1: d, m, then byte j holding code j in its low
    nibble and code j + 16 in its high one) -> codes uint8 [Np, K] and d, m fp16 [Np, G], N
    padded to Np (whole 16-channel tiles) with zero weights."""
    n, width = raw.shape
    if width % Q4_1_BLOCK_BYTES:
        raise ValueError(f"Q4_1 rows of {width} bytes are not whole blocks")
    g = width // Q4_1_BLOCK_BYTES
    blocks = raw.reshape(n, g, Q4_1_BLOCK_BYTES)
    d = blocks[:, :, 0:2].copy().view(np.float16).reshape(n, g)
    m = blocks[:, :, 2:4].copy().view(np.float16).reshape(n, g)
    qs = blocks[:, :, 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, g * Q4_1_BLOCK)  # [N, K]
    pad = -(-n // TILE) * TILE - n
    return tuple(np.pad(a, ((0, pad), (0, 0))) for a in (codes, d, m))  # type: ignore[return-value]


def _scale_tiles(a: np.ndarray) -> torch.Tensor:
    """d or m [Np, G] -> [T, G, 16]: a tile's 16 channels of one block side by side."""
    t, g = a.shape[0] // TILE, a.shape[1]
    return torch.from_numpy(np.ascontiguousarray(a.reshape(t, TILE, g).transpose(0, 2, 1)))


def pack_q4_1(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows [N, G * 20] -> kernels/q4_1.cpp's tiles: codes uint8 [T, K/2, 16] (byte = code
    of input 2p | code of input 2p + 1 << 4), d and m fp16 [T, G, 16]."""
    codes, d, m = unpack_q4_1(raw)
    t = codes.shape[0] // TILE
    pairs = codes.reshape(t, TILE, -1, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(0, 2, 1)  # [T, K/2, 16]
    return torch.from_numpy(np.ascontiguousarray(packed)), _scale_tiles(d), _scale_tiles(m)


def pack_q4_1_a8(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows [N, G * 20] -> matmul_q4_1's tiles (kernels/w8a8.cpp): codes uint8
    [T, G, 4, 16, 4], line i's lane c holding channel c's inputs 32g + 4i + j (low nibble) and
    32g + 16 + 4i + j (high nibble) for j < 4; d and m fp16 [T, G, 16]."""
    codes, d, m = unpack_q4_1(raw)
    t, g = codes.shape[0] // TILE, codes.shape[1] // Q4_1_BLOCK
    c = codes.reshape(t, TILE, g, 2, 4, 4)  # [T, channel, block, half, line, byte]
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4)
    return torch.from_numpy(np.ascontiguousarray(packed)), _scale_tiles(d), _scale_tiles(m)


class Q41Kernel(Protocol):
    """kernels/q4_1.cpp: Q4_1 tiles against float32 activations."""

    isa: str  # the build: "avx2" | "avx512"

    def matmul(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> torch.Tensor: ...

    def dequantize(
        self,
        q: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        n: int,
        n0: int,
        n1: int,
        out: torch.Tensor,
    ) -> torch.Tensor: ...


class Q41Linear(StreamedLinear):
    """GGUF Q4_1 weights (the file's codes, scales and minimums); float32 activations."""

    label = "Q4_1 as stored, float32 activations"

    def __init__(
        self, parts: list[GgufWeight], bias: torch.Tensor | None = None, isa: str | None = None
    ) -> None:
        self._ops = cast(Q41Kernel, kernels.load("q4_1", isa))
        raw = np.concatenate([p.raw for p in parts]) if len(parts) > 1 else parts[0].raw
        self.out_features = raw.shape[0]
        self.in_features = raw.shape[1] // Q4_1_BLOCK_BYTES * Q4_1_BLOCK
        self.q, self.d, self.m = pack_q4_1(raw)
        self._setup((self.q, self.d, self.m), bias, Q4_1_PREFILL_SCRATCH, self._ops.isa)

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self._ops.matmul(x, self.q, self.d, self.m, self.out_features, self.bias, residual)

    def _dequantize(self, n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
        """Bit for bit the gguf package's `d * q + m` (what `none` loads)."""
        return self._ops.dequantize(self.q, self.d, self.m, self.out_features, n0, n1, out)


class Q41A8Linear(RowsLinear):
    """GGUF Q4_1 weights (the file's codes, scales and minimums) times int8 activations, one
    scale per 32 inputs per row (`gguf-a8`): kernels/w8a8.cpp's matmul_q4_1 for every row
    count, as W8A8Linear."""

    label = "Q4_1 as stored, int8 activations"

    def __init__(
        self, parts: list[GgufWeight], bias: torch.Tensor | None = None, isa: str | None = None
    ) -> None:
        self._ops = w8a8.kernel(isa)  # isa: "avx2" | "vnni"; None picks by the CPU
        raw = np.concatenate([p.raw for p in parts]) if len(parts) > 1 else parts[0].raw
        self.out_features = raw.shape[0]
        self.in_features = raw.shape[1] // Q4_1_BLOCK_BYTES * Q4_1_BLOCK
        self.q, self.d, self.m = pack_q4_1_a8(raw)
        self.bias = float_bias(bias)
        packed = (self.q, self.d, self.m) + (() if self.bias is None else (self.bias,))
        self._nbytes = sum(t.nbytes for t in packed)

    def dequantized(self) -> torch.Tensor:
        """The float32 [in, out] weight (d * q + m), for tests and checks."""
        t, g = self.q.shape[:2]
        lo, hi = (self.q & 0x0F).long(), (self.q >> 4).long()  # [T, G, line, 16, byte]
        codes = torch.stack([lo, hi], dim=2)  # [T, G, half, line, 16, byte]
        codes = codes.permute(0, 1, 2, 3, 5, 4).reshape(t, g * Q4_1_BLOCK, TILE)  # [T, K, 16]
        d = self.d.float().repeat_interleave(Q4_1_BLOCK, dim=1)
        m = self.m.float().repeat_interleave(Q4_1_BLOCK, dim=1)
        w = d * codes.float() + m  # [T, K, 16]
        return w.permute(1, 0, 2).reshape(self.in_features, -1)[:, : self.out_features]

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self._ops.matmul_q4_1(
            x, self.q, self.d, self.m, self.out_features, self.bias, residual
        )


class Q41A16Linear(Q41A8Linear):
    """GGUF Q4_1 weights times int16 activations, one scale per 32 inputs per row (`gguf-a16`):
    kernels/w8a8.cpp's matmul_q4_1_a16 on gguf-a8's tiles, for every row count."""

    label = "Q4_1 as stored"

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self._ops.matmul_q4_1_a16(
            x, self.q, self.d, self.m, self.out_features, self.bias, residual
        )


def projection(
    parts: list[GgufWeight],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    what: str,
    activations: str = "float",
) -> Projection | None:
    """The stand-in running `parts` (the file's tensors fused into this [in, out] `weight`,
    e.g. q, k, v) in their own format, against `activations` (activations_of); None keeps the
    float weight (a float file tensor)."""
    kinds = {p.qtype for p in parts}
    if not kinds <= {Q4_1, Q8_0, *FLOAT_TYPES} or (len(kinds) > 1 and not kinds & {*FLOAT_TYPES}):
        # K-quants, Q4_0 / Q5_x, and fused parts in several formats: int16 activations only
        if activations != "int16":
            raise ValueError(
                f"quantization gguf: {what} is {'+'.join(sorted(kinds))}, which runs under "
                "--quantization gguf-a16 (the default for such a file) only"
            )
        return gguf_a16.projection(parts, bias, what)
    if len(kinds) != 1:
        raise ValueError(
            f"quantization gguf: {what} mixes block formats {sorted(kinds)} in one projection; "
            "use --quantization w8g32 or none"
        )
    kind = kinds.pop()
    if kind == Q4_1:
        q41 = {"int8": Q41A8Linear, "int16": Q41A16Linear}.get(activations, Q41Linear)
        return q41(parts, bias)
    if kind == Q8_0:  # w8g32's codes and scales are the file's (module docstring)
        q80 = {"int8": W8A8Linear, "int16": W8A16Linear}.get(activations, W8G32Linear)
        return q80(weight, bias)
    if kind in FLOAT_TYPES:
        return None
    raise ValueError(
        f"quantization gguf: {what} is {kind}, which pdserve has no kernel for (it runs Q4_1, "
        "Q8_0 and float tensors); use --quantization w8g32 or none"
    )
