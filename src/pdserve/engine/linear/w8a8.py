"""`--quantization w8a8`: the same int8 weights as w8g32 (its rounding and fp16 scales), times
activations quantized too, one scale per 32 inputs per row (llama.cpp's Q8 activations).

Integer dot products (kernels/w8a8.cpp) do 4 products per 32-bit lane per instruction where
w8g32 widens every weight to float, so 8 decode rows cost little more than 1 (quality and speed
in docs/benchmarks/quant.md and engine.md). `W8A16Linear` takes int16 activations instead:
gguf-a16's Q8_0 LM head. Which projections keep float32 activations is decided above
(quantize.W8A8_FLOAT_ACTIVATIONS).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

from pdserve.engine import kernels
from pdserve.engine.linear import w8g32
from pdserve.engine.linear.base import RowsLinear, float_bias

W8A8_TILE, W8A8_GROUP = 16, 32  # output channels per tile, inputs per scale (both kernels)

_Bias = torch.Tensor | None


class W8A8Kernel(Protocol):
    """kernels/w8a8.cpp: integer matmuls against int8 or int16 activations, quantized inside
    each call (x [M, K] float32 -> [M, n] float32, bias and residual added as it stores)."""

    isa: str  # the build: "avx2" | "vnni"
    rows: int  # rows per pass over a weight tile
    weight_offset: int  # added to each stored int8 weight code (vnni: 128)

    def matmul(
        self, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, n: int, bias: _Bias, res: _Bias
    ) -> torch.Tensor: ...

    def matmul_a16(
        self, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, n: int, bias: _Bias, res: _Bias
    ) -> torch.Tensor: ...

    def matmul_q4_1(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        n: int,
        bias: _Bias,
        res: _Bias,
    ) -> torch.Tensor: ...

    def matmul_q4_1_a16(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        n: int,
        bias: _Bias,
        res: _Bias,
    ) -> torch.Tensor: ...

    def matmul_k_a16(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        s: torch.Tensor,
        mn: torch.Tensor | None,
        n: int,
        bias: _Bias,
        res: _Bias,
    ) -> torch.Tensor: ...


def kernel(isa: str | None = None) -> W8A8Kernel:
    """The w8a8 kernel's `isa` build ("avx2" | "vnni"; None picks by the CPU)."""
    return cast(W8A8Kernel, kernels.load("w8a8", isa))


def quads(tiles: torch.Tensor, k: int) -> torch.Tensor:
    """w8g32's int8 tiles [T, K, 16] as w8a8's quads [T, Kp/4, 16, 4] (K zero-padded to whole
    groups of 32): one 64-byte line = 4 inputs x 16 channels, a channel's 4 inputs in one
    32-bit lane, what one vpdpbusd / vpmaddubsw takes."""
    t, kp = tiles.shape[0], -(-k // W8A8_GROUP) * W8A8_GROUP
    padded = torch.nn.functional.pad(tiles, (0, 0, 0, kp - k))
    return padded.view(t, kp // 4, 4, W8A8_TILE).permute(0, 1, 3, 2).contiguous()


class W8A8Linear(RowsLinear):
    """int8 weights (one fp16 scale per 32 inputs per output channel, w8g32's rounding) times
    int8 activations (one scale per 32 inputs per row, quantized inside the call): every group
    of 32 products is an exact int32 sum (kernels/w8a8.cpp; vpdpbusd where the CPU has AVX-512
    VNNI, vpmaddubsw elsewhere), scaled once. One kernel for every row count: decode rows stream
    the weights once for up to 8 (VNNI) / 4 (AVX2) rows at a time, prefill reuses a tile from
    cache across its row blocks."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: str | None = None
    ) -> None:
        self._ops = kernel(isa)  # isa: "avx2" | "vnni"; None picks by the CPU
        w = weight.detach().float().contiguous()  # [in, out]
        self.in_features, self.out_features = w.shape
        tiles, self.scales = w8g32.kernel().pack(w)  # w8g32's rounding, its scales
        # The VNNI build's int8 activations take its weights offset by 128 (unsigned bytes: see
        # w8a8.cpp); int16 activations (W8A16Linear) take them as they are.
        self._offset = self._weight_offset()
        self.q = quads(tiles, self.in_features) ^ (-self._offset)
        self.bias = float_bias(bias)
        self._nbytes = _packed_nbytes(self.q, self.scales, self.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 [in, out] weight this projection computes with (for tests and checks)."""
        k, t = self.in_features, self.q.shape[0]
        codes = self.q ^ (-self._offset)  # the stored bytes back to the signed codes
        q = codes.permute(0, 1, 3, 2).reshape(t, -1, W8A8_TILE)[:, :k]  # [T, K, 16]
        s = self.scales.float().repeat_interleave(W8A8_GROUP, dim=1)[:, :k]
        return (q.float() * s).permute(1, 0, 2).reshape(k, -1)[:, : self.out_features]

    def _weight_offset(self) -> int:
        return int(self._ops.weight_offset)

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self._ops.matmul(x, self.q, self.scales, self.out_features, self.bias, residual)


class W8A16Linear(W8A8Linear):
    """W8A8Linear's int8 weights (w8g32's rounding and scales) times int16 activations, one
    scale per 32 inputs per row (kernels/w8a8.cpp's matmul_a16): `gguf-a16`'s Q8_0 LM head.
    The input size must be a multiple of 32 (a GGUF block's)."""

    label = "int8 codes, fp16 scales (Q8_0 as stored)"

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: str | None = None
    ) -> None:
        if weight.shape[0] % W8A8_GROUP:
            raise ValueError(
                f"int16 activations take whole groups of {W8A8_GROUP} inputs; this weight has "
                f"{weight.shape[0]}"
            )
        super().__init__(weight, bias, isa)

    def _weight_offset(self) -> int:
        return 0  # signed codes in both builds (matmul_a16 widens them to int16)

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self._ops.matmul_a16(x, self.q, self.scales, self.out_features, self.bias, residual)


def _packed_nbytes(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> int:
    """Bytes a call reads from a group-wise packed weight: int8 values, fp16 scales, bias."""
    return q.numel() + scales.numel() * 2 + (0 if bias is None else bias.numel() * 4)
