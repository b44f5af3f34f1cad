"""The prefill format's projections (engine/prefill_format.py): bfloat16 copies of the weights
on torch's oneDNN GEMM (`BF16Linear`), or bf16x3 on AMX tiles (`AMXLinear`)."""

from __future__ import annotations

from typing import Protocol, cast

import torch

from pdserve.engine import kernels
from pdserve.engine.linear.base import float_bias


class Bf16Kernel(Protocol):
    """kernels/bf16.cpp: the element-wise ops between bfloat16 GEMMs."""

    def widen_add(
        self, y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
    ) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor: ...


class AmxKernel(Protocol):
    """kernels/amx.cpp: bf16x3 GEMMs and causal attention on AMX tiles."""

    def pack(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def matmul(
        self,
        x: torch.Tensor,
        hi: torch.Tensor,
        n: int,
        lo: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def matmul_silu(
        self, x: torch.Tensor, hi: torch.Tensor, n: int, lo: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def causal_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, split: bool = True
    ) -> torch.Tensor: ...


def bf16_kernel() -> Bf16Kernel:
    return cast(Bf16Kernel, kernels.load("bf16"))


def amx_kernel() -> AmxKernel:
    """Refused where the CPU lacks AMX or Linux will not hand this process the tile state."""
    return cast(AmxKernel, kernels.load("amx"))


class BF16Linear:
    """x @ W (+ bias) (+ residual) with W a bfloat16 [in, out] copy, on torch's oneDNN GEMM
    (AMX tiles where the CPU has them): x float32 or bfloat16 in (rounded to bfloat16), float32
    out (the GEMM accumulates in float32 and rounds its output to bfloat16; kernels/bf16.cpp
    widens it and adds bias and residual in one pass)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.detach().to(torch.bfloat16).contiguous()
        self.bias = float_bias(bias)
        self.out_features = self.weight.shape[1]
        self._ops = bf16_kernel()

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W in bfloat16 (no bias): what the next bfloat16 op reads as it is."""
        return (x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)) @ self.weight

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self._ops.widen_add(self.gemm(x), self.bias, residual)


class AMXLinear:
    """x @ W (+ bias) (+ residual) on AMX tiles (kernels/amx.cpp), float32 in and out:
    bf16x3, three bfloat16 products (x and W each split into a bfloat16 part and the bfloat16
    rounding of the rest), for float32-level agreement at the matrix units' rate."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self._ops = amx_kernel()
        self.hi, self.lo = self._ops.pack(weight.detach().float())
        self.bias = float_bias(bias)
        self.out_features = weight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self._ops.matmul(x, self.hi, self.out_features, self.lo, self.bias, residual)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate|up projection in the GEMM's store: [M, out / 2]."""
        assert self.bias is None
        return self._ops.matmul_silu(x, self.hi, self.out_features // 2, self.lo)
