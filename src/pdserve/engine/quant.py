"""Quantized projection weights: `--quantization none | int8`.

`int8` stores every projection matrix (q|k|v, o, gate|up, down, and the LM head) as int8 with
one scale per output channel and runs it with fbgemm's dynamic int8 GEMM
(`torch.ops.quantized.linear_dynamic`, the `x86` quantized engine). That kernel was chosen by
measurement (docs/benchmarks/quant.md): it has AVX2 and AVX-512/VNNI code paths, and on an
AVX2-only AMD EPYC it ran 1.7-3.4x faster than float32, where `torch._weight_int8pack_mm` and
bf16 matmuls run ~16x slower than float32 (no fast path without AVX-512).

fbgemm quantizes the activations with ONE scale per call (per tensor), which is too coarse
for this family of models (10-20% agreement with float32). The projection is row-wise
(y_t = x_t W), so each input row is divided by its own max-abs before the call and each output
row multiplied back afterwards (bias added after that): the kernel's single scale then acts
as one scale per token.

Activations use `reduce_range` (7-bit, 0..127): fbgemm's AVX2 and AVX-512 (non-VNNI) paths
sum pairs of u8 x s8 products in int16 (`vpmaddubsw`), which saturates with full 8-bit
activations; with 7 bits no pair can overflow, so every CPU kind computes the same numbers
(VNNI's `vpdpbusd` never saturates, so this machine could not show the difference).

The embedding lookup stays float32: a step reads only the rows of its own tokens.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Protocol, cast

import torch

from pdserve.config import QUANTIZATIONS, check_quantization

if TYPE_CHECKING:
    from pdserve.engine.models.llama import LlamaLayer, LlamaModel

LAYER_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class Projection(Protocol):
    """y = x @ W (+ bias), W [in, out]: how a layer runs one of its weight matrices."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


def check_supported(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse at start-up what cannot run quantized, instead of silently running float32."""
    check_quantization(name)
    if name == "none":
        return
    if device.type != "cpu":
        raise ValueError(f"quantization {name!r} runs on CPU only (device {device}); use none")
    if dtype != torch.float32:
        raise ValueError(
            f"quantization {name!r} takes float32 activations; use --dtype float32, not {dtype}"
        )
    engines = torch.backends.quantized.supported_engines
    if "x86" not in engines and "fbgemm" not in engines:
        raise ValueError(
            f"quantization {name!r} needs torch's fbgemm int8 kernels (x86 CPUs); this torch "
            f"has only {engines}"
        )


class Int8Linear:
    """int8 weights (one scale per output channel), int8 activations (one scale per token)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, reduce_range: bool = True
    ) -> None:
        self.reduce_range = reduce_range  # 7-bit activations; False only to measure the cost
        w = weight.detach().t().float().contiguous()  # [out, in], as fbgemm packs it
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        _use_fbgemm()
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Per-token scaling on top of the per-tensor kernel: rows at unit max-abs.
        amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
        y = torch.ops.quantized.linear_dynamic(x / amax, self._packed, self.reduce_range)
        if self.bias is None:
            return y.mul_(amax)
        return torch.addcmul(self.bias, y, amax)


def _use_fbgemm() -> None:
    """Pack with the x86 engine (fbgemm underneath); the packing is engine-specific."""
    engines = torch.backends.quantized.supported_engines
    torch.backends.quantized.engine = "x86" if "x86" in engines else "fbgemm"


def quantize(
    name: str, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> Projection | None:
    """The quantized stand-in for a [in, out] weight, or None for `none` (keep the float)."""
    if name == "none":
        return None
    if name == "int8":
        return Int8Linear(weight, bias)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {name!r}")


def quantize_model(model: LlamaModel, name: str, head: bool = True) -> None:
    """Replace every projection (and the LM head when `head`) by its quantized form, and free
    the float copies: a quantized model holds no float32 projection weights."""
    if name == "none":
        return
    for layer in layers_of(model):
        for proj in LAYER_PROJECTIONS:
            weight = getattr(layer, proj)
            bias = layer.qkv_bias if proj == "qkv" else None
            quantized = quantize(name, weight, bias)
            assert quantized is not None
            layer.quantized[proj] = quantized
            weight.data = weight.data.new_empty(0)
    if head:
        model.quantized_head = quantize(name, model.lm_head)
        model.lm_head.data = model.lm_head.data.new_empty(0)


def projection_bytes(model: LlamaModel) -> int:
    """Bytes of projection weights + LM head that one step reads, as stored (quantized or not)."""
    total = 0
    for layer in layers_of(model):
        for proj in LAYER_PROJECTIONS:
            quantized = layer.quantized.get(proj)
            total += quantized.nbytes if quantized else getattr(layer, proj).nbytes
    head = model.quantized_head
    return total + (head.nbytes if head else model.lm_head.nbytes)


def layers_of(model: LlamaModel) -> list[LlamaLayer]:
    return cast("list[LlamaLayer]", list(model.layers))
