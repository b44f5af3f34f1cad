"""`--quantization w8g32` (the quality-safe scheme): every projection matrix as int8 with one
fp16 scale per 32 inputs per output channel (group-wise), float32 activations.

It runs on a hand-written C++ kernel (kernels/w8g32.cpp): decode rows stream the int8 weight
tiles and dequantize in registers (a quarter of float32's bytes); prefill (more than
`base.gemv_rows()` rows) dequantizes column chunks into a float32 scratch and lets torch's GEMM
do the work. Why hand-written, when a well-kept library would do: none runs group-wise
weight-only int8 fast on CPU. Measured one thread on this machine's Xeon (AVX-512, torch 2.13,
both ATEN_CPU_CAPABILITY=avx2 and avx512), a [1536 x 576] weight at 1 / 8 / 32 rows: float32
linear 336 / 500-1300 / 1400-1800 us; `torch._weight_int8pack_mm` (per-channel only)
1000-2000 / 10000-29000 / 41000-89000 us; `torch._weight_int4pack_mm_for_cpu` (group 32)
3800-5900 us at 1 row -- all slower than float32; fbgemm's fast int8 path (linear/int8.py)
quantizes the activations, which fails quality. docs/benchmarks/quant.md has the quality table
that picked this scheme.

A GGUF file's Q8_0 tensors run here too: Q8_0 is this format (linear/gguf.py).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

from pdserve.engine import kernels
from pdserve.engine.linear.base import StreamedLinear

# Prefill dequantizes at most this many weights at a time (16 MB of float32 scratch): the LM head
# (49152 x 576) is done in column chunks instead of one 113 MB copy per call.
W8G32_SCRATCH = 1 << 22


class W8G32Kernel(Protocol):
    """kernels/w8g32.cpp's group-wise int8 calls."""

    isa: str  # the build: "avx2" | "avx512"
    rows: int  # rows per pass over a weight tile

    def pack(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def matmul(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        scales: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> torch.Tensor: ...

    def dequantize(
        self, q: torch.Tensor, scales: torch.Tensor, n: int, n0: int, n1: int, out: torch.Tensor
    ) -> torch.Tensor: ...


def kernel(isa: str | None = None) -> W8G32Kernel:
    """The w8g32 kernel's `isa` build ("avx2" | "avx512"; None picks by the CPU)."""
    return cast(W8G32Kernel, kernels.load("w8g32", isa))


class W8G32Linear(StreamedLinear):
    """int8 weights, one fp16 scale per 32 inputs per output channel; float32 activations."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: str | None = None
    ) -> None:
        # isa: the kernel build ("avx2" | "avx512"); None picks by the CPU (tests name one).
        self._ops = kernel(isa)
        w = weight.detach().float().contiguous()  # [in, out]
        self.in_features, self.out_features = w.shape
        self.q, self.scales = self._ops.pack(w)
        self._setup((self.q, self.scales), bias, W8G32_SCRATCH, self._ops.isa)

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self._ops.matmul(x, self.q, self.scales, self.out_features, self.bias, residual)

    def _dequantize(self, n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
        return self._ops.dequantize(self.q, self.scales, self.out_features, n0, n1, out)
