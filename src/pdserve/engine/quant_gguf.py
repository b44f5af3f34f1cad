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
Any other block format (Q4_K, Q6_K, ...) is refused at start-up with the tensor named: no
silent float32 fallback. Only the greedy-parity rule of `none` does not apply: the sums run in
another order than torch's GEMM (quality: docs/benchmarks/quant.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

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
    """One weight matrix as the file stores it: `rows` output channels of `qtype` blocks,
    `raw` [rows, bytes per row] (Q/K rows already in HF order)."""

    qtype: str
    raw: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])


def pack_q4_1(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows [N, G * 20] (ggml's block_q4_1: d, m, then byte j holding code j in its low
    nibble and code j + 16 in its high one) -> the kernel's tiles: codes uint8 [T, K/2, 16]
    (byte = code of input 2p | code of input 2p + 1 << 4), d and m fp16 [T, G, 16]; N padded
    to whole tiles with zero weights."""
    n, width = raw.shape
    if width % Q4_1_BLOCK_BYTES:
        raise ValueError(f"Q4_1 rows of {width} bytes are not whole blocks")
    g = width // Q4_1_BLOCK_BYTES
    blocks = raw.reshape(n, g, Q4_1_BLOCK_BYTES)
    d = blocks[:, :, 0:2].copy().view(np.float16).reshape(n, g)
    m = blocks[:, :, 2:4].copy().view(np.float16).reshape(n, g)
    qs = blocks[:, :, 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, g * Q4_1_BLOCK)  # [N, K]
    t = -(-n // TILE)
    pad = t * TILE - n
    codes = np.pad(codes, ((0, pad), (0, 0)))
    d, m = np.pad(d, ((0, pad), (0, 0))), np.pad(m, ((0, pad), (0, 0)))
    pairs = codes.reshape(t, TILE, -1, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(0, 2, 1)  # [T, K/2, 16]

    def tiles(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.reshape(t, TILE, g).transpose(0, 2, 1)))

    return torch.from_numpy(np.ascontiguousarray(packed)), tiles(d), tiles(m)


class Q41Linear:
    """GGUF Q4_1 weights (the file's codes, scales and minimums); float32 activations."""

    def __init__(
        self, parts: list[GgufWeight], bias: torch.Tensor | None = None, isa: str | None = None
    ) -> None:
        from pdserve.engine import kernels
        from pdserve.engine.quant import gemv_rows

        self._ops = kernels.q4_1_module(isa)
        raw = np.concatenate([p.raw for p in parts]) if len(parts) > 1 else parts[0].raw
        self.out_features = raw.shape[0]
        self.in_features = raw.shape[1] // Q4_1_BLOCK_BYTES * Q4_1_BLOCK
        self.q, self.d, self.m = pack_q4_1(raw)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._nbytes = self.q.numel() + 2 * (self.d.numel() + self.m.numel())
        self._nbytes += 0 if self.bias is None else self.bias.numel() * 4
        self._gemv_rows = gemv_rows(self._ops.isa)
        cols = max(TILE, (Q4_1_PREFILL_SCRATCH // max(1, self.in_features)) // TILE * TILE)
        self._chunk = min(self.out_features, cols)

    @property
    def nbytes(self) -> int:
        """Bytes read per decode call: codes + scales + minimums (+ bias)."""
        return self._nbytes

    def dequantized(self) -> torch.Tensor:
        """The float32 [in, out] weight (d * q + m), for tests and checks."""
        n = self.out_features
        out = torch.empty(self.in_features, n)
        return self._ops.dequantize(self.q, self.d, self.m, n, 0, n, out)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        from pdserve.engine.quant import _add_residual, _flat_rows, _native_residual, _rows

        if _flat_rows(x, self.in_features) and x.shape[0] <= self._gemv_rows:
            return self._matmul(x, residual)
        lead = x.shape[:-1]
        x2 = _rows(x, self.in_features).float()
        if x2.shape[0] <= self._gemv_rows:
            y = self._matmul(x2, _native_residual(x, residual))
        else:
            y = _add_residual(self._prefill(x2), residual)
        return y.reshape(*lead, self.out_features)

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self._ops.matmul(x, self.q, self.d, self.m, self.out_features, self.bias, residual)

    def _prefill(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows: dequantize column chunks into the shared scratch, then torch's GEMM."""
        from pdserve.engine.quant import _scratch

        n = self.out_features
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        for n0 in range(0, n, self._chunk):
            n1 = min(n, n0 + self._chunk)
            w = self._ops.dequantize(
                self.q, self.d, self.m, n, n0, n1, _scratch(self.in_features, n1 - n0)
            )
            y[:, n0:n1] = x @ w if self.bias is None else torch.addmm(self.bias[n0:n1], x, w)
        return y


def projection(
    parts: list[GgufWeight], weight: torch.Tensor, bias: torch.Tensor | None, what: str
) -> object | None:
    """The stand-in running `parts` (the file's tensors fused into this [in, out] `weight`,
    e.g. q, k, v) in their own format; None keeps the float weight (a float file tensor)."""
    from pdserve.engine.quant import W8G32Linear

    kinds = {p.qtype for p in parts}
    if len(kinds) != 1:
        raise ValueError(
            f"quantization gguf: {what} mixes block formats {sorted(kinds)} in one projection; "
            "use --quantization w8g32 or none"
        )
    kind = kinds.pop()
    if kind == Q4_1:
        return Q41Linear(parts, bias)
    if kind == Q8_0:
        return W8G32Linear(weight, bias)  # the same codes and scales (module docstring)
    if kind in FLOAT_TYPES:
        return None
    raise ValueError(
        f"quantization gguf: {what} is {kind}, which pdserve has no kernel for (it runs Q4_1, "
        "Q8_0 and float tensors); use --quantization w8g32 or none"
    )
