"""`--quantization int8`: every projection matrix (q|k|v, o, gate|up, down, and the LM head) as
int8 with one scale per output channel, run with fbgemm's dynamic int8 GEMM
(`torch.ops.quantized.linear_dynamic`, the `x86` quantized engine).

That kernel was chosen by measurement (docs/benchmarks/quant.md): it has AVX2 and
AVX-512/VNNI code paths, and on an AVX2-only AMD EPYC it ran 1.7-3.4x faster than float32,
where `torch._weight_int8pack_mm` and bf16 matmuls run ~16x slower than float32 (no fast path
without AVX-512).

fbgemm quantizes the activations with ONE scale per call (per tensor), which is too coarse
for this family of models (10-20% agreement with float32). The projection is row-wise
(y_t = x_t W), so each input row is divided by its own max-abs before the call and each output
row multiplied back afterwards (bias added after that): the kernel's single scale then acts
as one scale per token.

Activations use `reduce_range` (7-bit, 0..127): fbgemm's AVX2 and AVX-512 (non-VNNI) paths
sum pairs of u8 x s8 products in int16 (`vpmaddubsw`), which saturates with full 8-bit
activations; with 7 bits no pair can overflow, so every CPU kind computes the same numbers
(VNNI's `vpdpbusd` never saturates, so this machine could not show the difference).
"""

from __future__ import annotations

import warnings

import torch

from pdserve.engine.linear.base import add_residual


class Int8Linear:
    """int8 weights (one scale per output channel), int8 activations (one scale per token)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, reduce_range: bool = True
    ) -> None:
        self.reduce_range = reduce_range  # 7-bit activations; False only to measure the cost
        w = weight.detach().t().float().contiguous()  # [out, in], as fbgemm packs it
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        use_fbgemm()
        with warnings.catch_warnings():
            # Quantized-tensor creation is deprecated in torch 2.13 in favour of torchao; the
            # packed kernel itself is not. (pyproject pins torch; see docs/benchmarks/quant.md.)
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(q, None)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self._nbytes = w.numel() + scales.numel() * 4 + (0 if bias is None else bias.numel() * 4)

    @property
    def nbytes(self) -> int:
        """Bytes read per call: int8 weights + float32 scales (+ bias)."""
        return self._nbytes

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # Per-token scaling on top of the per-tensor kernel: rows at unit max-abs.
        amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
        y = torch.ops.quantized.linear_dynamic(x / amax, self._packed, self.reduce_range)
        y = y.mul_(amax) if self.bias is None else torch.addcmul(self.bias, y, amax)
        return add_residual(y, residual)


def use_fbgemm() -> None:
    """Pack with the x86 engine (fbgemm underneath); the packing is engine-specific."""
    engines = torch.backends.quantized.supported_engines
    torch.backends.quantized.engine = "x86" if "x86" in engines else "fbgemm"
