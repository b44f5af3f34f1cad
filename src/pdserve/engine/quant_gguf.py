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
projections whose parts mix formats, run under `gguf-a16` on engine/gguf_linear.py's kernels,
their own codes and scales as stored. Any other block format is refused at start-up with the
tensor named under `gguf*`, and `auto` runs such a file as float32 under a WARNING naming the
formats and the cost: never silently. Only the greedy-parity rule of `none` does not apply:
the sums run in another order than torch's GEMM (quality: docs/benchmarks/quant.md).

`gguf-a8` runs the same weights against int8 activations (one scale per 32 inputs per row, as
llama.cpp's Q8 activations): Q4_1 on kernels/w8a8.cpp's matmul_q4_1 (integer dot products of the
codes), Q8_0 on W8A8Linear, q|k|v on float activations as under w8a8
(quant.W8A8_FLOAT_ACTIVATIONS). The speed of integer arithmetic where a batch of rows makes the
float kernel compute-bound, for the activations' rounding.

`gguf-a16` runs the same Q4_1 weights against int16 activations (one scale per 32 inputs per
row; kernels/w8a8.cpp's matmul_q4_1_a16), every projection, at every row count (decode and
prefill): the codes are multiplied as integers (vpdpwssd / vpmaddwd) instead of widened to
float one by one, and the rounding (2^-16 of each block's largest input) is below the float16
KV cache's. A Q8_0 tensor (the default model's LM head) runs w8g32's codes and scales against
the same int16 activations (quant.W8A16Linear, matmul_a16).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from pdserve.engine import gguf_linear, loader, model_cache
from pdserve.engine.loader import ModelSource
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.quant import (
    RowsLinear,
    StreamedLinear,
    W8A8Linear,
    W8A16Linear,
    W8G32Linear,
)

log = logging.getLogger(__name__)

# The quantizations that run a GGUF file's own weights: float32, int8 or int16 activations.
GGUF_QUANTIZATIONS = ("gguf", "gguf-a8", "gguf-a16")
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


class Q41A8Linear(RowsLinear):
    """GGUF Q4_1 weights (the file's codes, scales and minimums) times int8 activations, one
    scale per 32 inputs per row (`gguf-a8`): kernels/w8a8.cpp's matmul_q4_1 for every row
    count, as W8A8Linear."""

    def __init__(
        self, parts: list[GgufWeight], bias: torch.Tensor | None = None, isa: str | None = None
    ) -> None:
        from pdserve.engine import kernels

        self._ops = kernels.w8a8_module(isa)  # isa: "avx2" | "vnni"; None picks by the CPU
        raw = np.concatenate([p.raw for p in parts]) if len(parts) > 1 else parts[0].raw
        self.out_features = raw.shape[0]
        self.in_features = raw.shape[1] // Q4_1_BLOCK_BYTES * Q4_1_BLOCK
        self.q, self.d, self.m = pack_q4_1_a8(raw)
        self.bias = None if bias is None else bias.detach().float().contiguous()
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
        y = self._ops.matmul_q4_1(x, self.q, self.d, self.m, self.out_features, self.bias, residual)
        return cast(torch.Tensor, y)


class Q41A16Linear(Q41A8Linear):
    """GGUF Q4_1 weights times int16 activations, one scale per 32 inputs per row (`gguf-a16`):
    kernels/w8a8.cpp's matmul_q4_1_a16 on gguf-a8's tiles, for every row count."""

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        y = self._ops.matmul_q4_1_a16(
            x, self.q, self.d, self.m, self.out_features, self.bias, residual
        )
        return cast(torch.Tensor, y)


def activations_of(quantization: str, proj: str) -> str:
    """What projection `proj` (or "head") of a GGUF quantization multiplies its weights with:
    "float", "int8" (gguf-a8, but for q|k|v) or "int16" (gguf-a16)."""
    from pdserve.engine.quant import W8A8_FLOAT_ACTIVATIONS

    if quantization == "gguf-a8" and proj not in W8A8_FLOAT_ACTIVATIONS:
        return "int8"
    return "int16" if quantization == "gguf-a16" else "float"


def projection(
    parts: list[GgufWeight],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    what: str,
    activations: str = "float",
) -> object | None:
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
        return gguf_linear.projection(parts, bias, what)
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


def resolve_quantization(
    name: str,
    model: ModelSource | str | os.PathLike[str] | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = "float32",
) -> str:
    """`--quantization auto` (the default) made concrete; any other name is returned as it is.

    auto is `gguf-a16` for a GGUF file whose weight matrices are all in formats with a kernel
    here (gguf_linear.FORMATS: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; or float) and at
    least one quantized, on a CPU with AVX2, float32: the file's
    own weights, as llama.cpp and vLLM run a GGUF file, against int16 activations. Measured side
    by side (docs/benchmarks/quant.md, 60 chat prompts x 64 tokens, float16 KV): 59 of 60
    outputs equal to float32's under gguf-a16 as under gguf (float activations), KL 3.6e-7
    against 3.0e-7, in 0.71x the time; its projections take 0.58-0.66x gguf's at every row
    count (engine.md). Anything else (an HF folder, CUDA, bfloat16, a file in another block
    format: warned) is `none`.
    The choice is logged and shown wherever the quantization is (stats, /admin/workers, the
    cost-model file name)."""
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
            # 2-D weights, and a mixture of experts' 3-D [expert, out, in] (models/moe.py)
            if len(t.shape) in (2, 3) and loader.gguf_hf_name(t.name) is not None
        }
        quantized = kinds - set(FLOAT_TYPES)
        if quantized and quantized <= set(gguf_linear.FORMATS):
            chosen = "gguf-a16"
        elif quantized:
            _warn_float(src, quantized - set(gguf_linear.FORMATS))
    log.info("quantization auto: %s (%s)", chosen, src.path.name)
    return chosen


def _warn_float(src: ModelSource, missing: set[str]) -> None:
    """A GGUF file holding block formats without a kernel here runs as float32: say so loudly,
    with the cost (issue 44: never silently as float)."""
    log.warning(
        "%s holds %s tensors, which pdserve has no kernel for: the whole model runs "
        "dequantized to float32 (--quantization none), reading ~7x the bytes a decode step of "
        "a 4-bit format reads (decode several times slower). Kernels exist for %s.",
        src.path.name,
        ", ".join(sorted(missing)),
        ", ".join(gguf_linear.FORMATS),
    )


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
