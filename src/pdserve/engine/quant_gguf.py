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

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine import loader, model_cache
from pdserve.engine.loader import ModelSource
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.quant import StreamedLinear, W8G32Linear

log = logging.getLogger(__name__)

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


class Q41Linear(StreamedLinear):
    """GGUF Q4_1 weights (the file's codes, scales and minimums); float32 activations."""

    def __init__(
        self, parts: list[GgufWeight], bias: torch.Tensor | None = None, isa: str | None = None
    ) -> None:
        from pdserve.engine import kernels

        self._ops = kernels.q4_1_module(isa)
        raw = np.concatenate([p.raw for p in parts]) if len(parts) > 1 else parts[0].raw
        self.out_features = raw.shape[0]
        self.in_features = raw.shape[1] // Q4_1_BLOCK_BYTES * Q4_1_BLOCK
        self.q, self.d, self.m = pack_q4_1(raw)
        self._setup((self.q, self.d, self.m), bias, Q4_1_PREFILL_SCRATCH)

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self._ops.matmul(x, self.q, self.d, self.m, self.out_features, self.bias, residual)

    def _dequantize(self, n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
        """Bit for bit the gguf package's `d * q + m` (what `none` loads)."""
        return self._ops.dequantize(self.q, self.d, self.m, self.out_features, n0, n1, out)


def projection(
    parts: list[GgufWeight], weight: torch.Tensor, bias: torch.Tensor | None, what: str
) -> object | None:
    """The stand-in running `parts` (the file's tensors fused into this [in, out] `weight`,
    e.g. q, k, v) in their own format; None keeps the float weight (a float file tensor)."""
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


def resolve_quantization(
    name: str,
    model: ModelSource | str | os.PathLike[str] | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = "float32",
) -> str:
    """`--quantization auto` (the default) made concrete; any other name is returned as it is.

    auto is `gguf` for a GGUF file whose weight matrices are all in formats with a kernel here
    (Q4_1, Q8_0, float) and at least one quantized, on a CPU with AVX2, float32: the file's own
    weights, as llama.cpp and vLLM run a GGUF file (60 of 60 outputs equal to float32's,
    docs/benchmarks/quant.md). Anything else (an HF folder, a K-quant file, CUDA, bfloat16) is
    `none`. The choice is logged and shown wherever the quantization is (stats, /admin/workers,
    the cost-model file name)."""
    if name != "auto":
        return name
    from pdserve.engine import kernels

    src = model if isinstance(model, ModelSource) else loader.resolve_model(model)
    chosen = "none"
    on_cpu = torch.device(device).type == "cpu" and str(dtype).removeprefix("torch.") == "float32"
    if src.kind == "gguf" and on_cpu and kernels.cpu_supported():
        kinds = {
            t.qtype.name
            for t in model_cache.gguf_index(src.path).tensors
            if len(t.shape) == 2 and loader.gguf_hf_name(t.name) is not None
        }
        quantized = kinds - set(FLOAT_TYPES)
        if quantized and quantized <= {Q4_1, Q8_0}:
            chosen = "gguf"
    log.info("quantization auto: %s (%s)", chosen, src.path.name)
    return chosen


def gguf_weights(src: ModelSource, arch: ModelArch) -> dict[str, GgufWeight]:
    """Every 2-D weight of a GGUF model as the file stores it (its block format and raw rows),
    by HF name, Q/K rows unpermuted as in `_gguf_weights`: what `--quantization gguf` runs."""
    if src.kind != "gguf":
        raise ValueError(
            f"quantization gguf runs a GGUF file's own weights; {src.folder} is not a GGUF model"
        )
    index = model_cache.gguf_index(src.path)
    file = np.memmap(src.path, dtype=np.uint8, mode="r")
    permuted = index.field("general.architecture") == "llama"
    out: dict[str, GgufWeight] = {}
    for tensor in index.tensors:
        name = loader.gguf_hf_name(tensor.name)
        if name is None or len(tensor.shape) != 2:
            continue
        rows = int(tensor.shape[1])  # GGUF lists dims fastest-first: [in, out]
        raw = np.asarray(index.data(file, tensor)).view(np.uint8).reshape(rows, -1)
        if permuted and ".self_attn.q_proj." in name:
            raw = loader.unpermute_rows(raw, arch.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            raw = loader.unpermute_rows(raw, arch.num_kv_heads)
        out[name] = GgufWeight(tensor.qtype.name, np.array(raw))  # copy: the file is mmapped
    return out
