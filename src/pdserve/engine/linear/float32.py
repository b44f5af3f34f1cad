"""float32 weights as projections: `FloatLinear` (the weight as it is, torch's matmul) and
`F32TileLinear` (`--decode-matmul tiles`: the streaming kernel's tiles of the same weight for
calls of a few rows)."""

from __future__ import annotations

from typing import Protocol, cast

import torch

from pdserve.engine import kernels
from pdserve.engine.linear.base import add_residual, as_rows, native_residual

# The float32 tiles (F32TileLinear) against MKL's GEMM on the float weight itself (no
# dequantizing): on the same Xeon the tiles were 1.26-1.43x faster at 8 rows, 0.93-1.13x at 16,
# 0.71-0.92x at 24, so 16 rows there; elsewhere as many as the kernel takes.
F32_TILE_ROWS_INTEL = 16


class FloatLinear:
    """A float32 [in, out] weight as a projection (the decode format of `--quantization none`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)
        return y if residual is None else residual + y


class TileKernel(Protocol):
    """kernels/w8g32.cpp's float32 tile calls."""

    f32_max_rows: int  # most rows one call takes

    def pack_f32(self, w: torch.Tensor) -> torch.Tensor: ...

    def matmul_f32(
        self,
        x: torch.Tensor,
        tiles: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> torch.Tensor: ...


class F32TileLinear:
    """A float32 projection that keeps its weight and adds the streaming kernel's 16-channel
    tiles of it (kernels/w8g32.cpp, matmul_f32): calls of at most `rows` rows (decode steps, short
    chunks) stream the tiles once for every row, larger ones (prefill) run torch's GEMM on the
    original weight, exactly as an untiled model does. The price is a second copy of the weights.

    Why: torch's GEMM (MKL) at 2-16 rows takes 2.7-4x the time of 1 row on the AMD EPYC we
    measured, though every row count reads the same weights (docs/benchmarks/engine.md)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: str | None = None
    ) -> None:
        self._ops = cast(TileKernel, kernels.load("w8g32", isa))
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"tiles take a float32 [in, out] weight, got {weight.dtype}")
        self.weight = weight  # [in, out], the model's own tensor (not copied)
        self.bias = bias
        self.in_features, self.out_features = weight.shape
        self.tiles = self._ops.pack_f32(weight.detach())
        # Intel: up to 16 rows, where MKL's own fast paths start (F32_TILE_ROWS_INTEL);
        # elsewhere as many rows as the kernel takes (64).
        intel = kernels.cpu_vendor() == "GenuineIntel"
        self.rows = min(int(self._ops.f32_max_rows), F32_TILE_ROWS_INTEL if intel else 1 << 62)

    @property
    def nbytes(self) -> int:
        """Bytes read per decode call: the float32 tiles (+ bias)."""
        return self.tiles.numel() * 4 + (0 if self.bias is None else self.bias.numel() * 4)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = as_rows(x, self.in_features)
        if x2.shape[0] <= self.rows:
            res = native_residual(x, residual)
            y = self._ops.matmul_f32(x2, self.tiles, self.out_features, self.bias, res)
        elif self.bias is None:
            y = add_residual(x2 @ self.weight, residual)
        else:
            y = add_residual(torch.addmm(self.bias, x2, self.weight), residual)
        return y.reshape(*lead, self.out_features)
