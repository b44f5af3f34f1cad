"""Quantized projection weights: `--quantization none | int8 | w8g32 | w8a8 | gguf | gguf-a8 |
gguf-a16`.

`gguf` runs a GGUF file's own Q4_1 / Q8_0 weights as stored, `gguf-a8` and `gguf-a16` the same
weights against int8 / int16 activations (engine/quant_gguf.py).

`w8a8` stores the same int8 weights as w8g32 and quantizes the activations too, one scale per
32 inputs per row (llama.cpp's Q8 activations): integer dot products (kernels/w8a8.cpp) do 4
products per 32-bit lane per instruction where w8g32 widens every weight to float, so 8 decode
rows cost little more than 1 (W8A8Linear below; quality and speed in docs/benchmarks/quant.md
and engine.md). The q|k|v projection keeps float32 activations (W8A8_FLOAT_ACTIVATIONS).

`w8g32` (the quality-safe scheme) stores every projection matrix as int8 with one fp16 scale per
32 inputs per output channel (group-wise) and keeps the activations float32. It runs on a
hand-written C++ kernel (kernels/w8g32.cpp, `-mavx2 -mfma -mf16c`, built on first use and
cached): decode rows stream the int8 weight tiles and dequantize in registers (a quarter of
float32's bytes); prefill (more than `gemv_rows()` rows) dequantizes column chunks into a
float32 scratch and lets torch's GEMM do the work. Why hand-written, when the issue asks for a
well-kept library first: none runs group-wise weight-only int8 fast on CPU. Measured one thread
on this machine's Xeon (AVX-512, torch 2.13, both ATEN_CPU_CAPABILITY=avx2 and avx512), a
[1536 x 576] weight at 1 / 8 / 32 rows: float32 linear 336 / 500-1300 / 1400-1800 us;
`torch._weight_int8pack_mm` (per-channel only) 1000-2000 / 10000-29000 / 41000-89000 us;
`torch._weight_int4pack_mm_for_cpu` (group 32) 3800-5900 us at 1 row -- all slower than
float32; fbgemm's fast int8 path (`int8` below) quantizes the activations, which fails quality.
docs/benchmarks/quant.md has the quality table that picked this scheme.

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

import threading
import warnings
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from pdserve.config import DECODE_MATMULS, QUANTIZATIONS, check_quantization

if TYPE_CHECKING:
    from pdserve.engine.models.llama import LlamaLayer, LlamaModel
    from pdserve.engine.quant_gguf import GgufWeight

LAYER_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# A mixture-of-experts layer's dense projections: its MLP is its experts (engine/moe_quant.py).
ATTENTION_PROJECTIONS = ("qkv", "o")
# The quantizations that run pdserve's own kernels (w8g32.cpp, w8a8.cpp, q4_1.cpp) and its
# native RMSNorm / RoPE / silu * up (FusedOps).
NATIVE_QUANTIZATIONS = ("w8g32", "w8a8", "gguf", "gguf-a8", "gguf-a16")


class Projection(Protocol):
    """y = x @ W (+ bias) (+ residual), W [in, out]: how a layer runs one of its weight
    matrices. `residual` (x's rows by W's outputs) is added last, as torch's
    `residual + (x @ W + bias)` would: native kernels add it as they store their output."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor: ...

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
    if name in NATIVE_QUANTIZATIONS:
        from pdserve.engine import kernels

        if not kernels.cpu_supported():
            raise ValueError(
                f"quantization {name!r} needs a CPU with AVX2 + FMA (torch reports "
                f"{torch.backends.cpu.get_cpu_capability()}); use --quantization none"
            )
        return
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

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # Per-token scaling on top of the per-tensor kernel: rows at unit max-abs.
        amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
        y = torch.ops.quantized.linear_dynamic(x / amax, self._packed, self.reduce_range)
        y = y.mul_(amax) if self.bias is None else torch.addcmul(self.bias, y, amax)
        return _add_residual(y, residual)


# Rows up to the limit run the streaming kernel; more rows (prefill) dequantize into a float32
# scratch and use torch's GEMM. Measured with 30 copies of a weight cycled as a decode step
# cycles its layers (one thread; docs/benchmarks/engine.md): on the Intel Xeon (model 207) the
# kernel beat dequantize + MKL's GEMM 2.3-2.9x at 16 rows, 1.09-1.24x at 64 and was level at
# 128 ([576 x 3072] 1.05x, [1536 x 576] 0.90x), so the limit is 64 there (it was 16, from a
# single weight in cache, which put batch-32 decode steps on the GEMM path at 6x the time of
# batch 8). MKL runs slower code paths on other vendors' CPUs: on an AMD EPYC (Zen 5) the
# AVX-512 kernel ran 1.8-2x faster than MKL's float32 GEMM at every row count measured (8 to
# 2048), and the AVX2 build up to ~64 rows, so there the limit is none / 64.
W8G32_GEMV_ROWS = 64
W8G32_GEMV_ROWS_NOT_INTEL = {"avx512": 1 << 62, "avx2": 64}
# The float32 tiles (F32TileLinear) against MKL's GEMM on the float weight itself (no
# dequantizing): on the same Xeon the tiles were 1.26-1.43x faster at 8 rows, 0.93-1.13x at 16,
# 0.71-0.92x at 24, so 16 rows there; elsewhere as many as the kernel takes.
F32_TILE_ROWS_INTEL = 16


def gemv_rows(isa: str) -> int:
    """Most rows the streaming kernel takes for this build on this CPU (see above)."""
    from pdserve.engine import kernels

    if kernels.cpu_vendor() == "GenuineIntel":
        return W8G32_GEMV_ROWS
    return W8G32_GEMV_ROWS_NOT_INTEL.get(isa, W8G32_GEMV_ROWS)


# Prefill dequantizes at most this many weights at a time (16 MB of float32 scratch): the LM head
# (49152 x 576) is done in column chunks instead of one 113 MB copy per call.
W8G32_SCRATCH = 1 << 22


def _packed_nbytes(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> int:
    """Bytes a call reads from a group-wise packed weight: int8 values, fp16 scales, bias."""
    return q.numel() + scales.numel() * 2 + (0 if bias is None else bias.numel() * 4)


def _add_residual(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """y + residual in y's storage (the same values as `residual + y`), for the paths whose
    kernel does not add it."""
    return y if residual is None else y.add_(residual)


def _native_residual(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
    """The residual as a native kernel takes it ([rows, out] float32), when x is 2-D as the
    layers pass it; None when there is none. A kernel refuses any other shape."""
    if residual is not None and x.dim() != 2:
        raise ValueError(f"a residual needs a 2-D input, got {tuple(x.shape)}")
    return residual


def _flat_rows(x: torch.Tensor, in_features: int) -> bool:
    """x is float32 [rows, in_features], as the layers pass it: the kernel takes it as it is
    (a step's four reshapes, dtype checks and calls per projection cost ~0.5 ms at batch 1)."""
    return x.dim() == 2 and x.shape[1] == in_features and x.dtype == torch.float32


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as [rows, in_features] (a view where it can be), or a clear error for another width."""
    if x.shape[-1] != in_features:
        raise ValueError(f"input has {x.shape[-1]} features, weight takes {in_features}")
    return x.reshape(-1, in_features)


class StreamedLinear:
    """A packed weight that a native kernel streams for up to `gemv_rows()` rows (decode) and
    dequantizes in column chunks for torch's GEMM past that (prefill): w8g32's int8 here, and
    gguf's Q4_1 (quant_gguf.Q41Linear). A subclass packs its weight, sets `_ops` and calls
    `_setup`; it supplies the kernel's matmul and dequantize calls."""

    _ops: Any
    in_features: int
    out_features: int
    bias: torch.Tensor | None

    def _setup(
        self, packed: tuple[torch.Tensor, ...], bias: torch.Tensor | None, scratch_floats: int
    ) -> None:
        """`packed`: the tensors a decode call reads (codes, scales, ...)."""
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._nbytes = sum(t.nbytes for t in packed) + (
            0 if self.bias is None else self.bias.nbytes
        )
        self._gemv_rows = gemv_rows(self._ops.isa)
        # Columns per prefill chunk: a multiple of the kernels' 16-channel tiles.
        cols = max(16, (scratch_floats // max(1, self.in_features)) // 16 * 16)
        self._chunk = min(self.out_features, cols)

    @property
    def nbytes(self) -> int:
        """Bytes read per decode call: the packed weight (+ bias)."""
        return self._nbytes

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def _dequantize(self, n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
        """Columns [n0, n1) of the float32 weight into out [in, n1 - n0]."""
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The float32 [in, out] weight this projection computes with (for tests and checks)."""
        n = self.out_features
        return self._dequantize(0, n, torch.empty(self.in_features, n))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if _flat_rows(x, self.in_features) and x.shape[0] <= self._gemv_rows:
            return self._matmul(x, residual)
        lead = x.shape[:-1]
        x2 = _rows(x, self.in_features).float()
        if x2.shape[0] <= self._gemv_rows:
            y = self._matmul(x2, _native_residual(x, residual))
        else:
            y = _add_residual(self._prefill(x2), residual)
        return y.reshape(*lead, self.out_features)

    def _prefill(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        if self._chunk >= n:
            w = self._dequantize(0, n, _scratch(self.in_features, n))
            return x @ w if self.bias is None else torch.addmm(self.bias, x, w)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        for n0 in range(0, n, self._chunk):
            n1 = min(n, n0 + self._chunk)
            w = self._dequantize(n0, n1, _scratch(self.in_features, n1 - n0))
            y[:, n0:n1] = x @ w if self.bias is None else torch.addmm(self.bias[n0:n1], x, w)
        return y


class W8G32Linear(StreamedLinear):
    """int8 weights, one fp16 scale per 32 inputs per output channel; float32 activations."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: str | None = None
    ) -> None:
        from pdserve.engine import kernels

        # isa: the kernel build ("avx2" | "avx512"); None picks by the CPU (tests name one).
        self._ops = kernels.w8g32_module(isa)
        w = weight.detach().float().contiguous()  # [in, out]
        self.in_features, self.out_features = w.shape
        self.q, self.scales = self._ops.pack(w)
        self._setup((self.q, self.scales), bias, W8G32_SCRATCH)

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self._ops.matmul(x, self.q, self.scales, self.out_features, self.bias, residual)

    def _dequantize(self, n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
        return self._ops.dequantize(self.q, self.scales, self.out_features, n0, n1, out)


W8A8_TILE, W8A8_GROUP = 16, 32  # output channels per tile, inputs per scale (both kernels)


def _quads(tiles: torch.Tensor, k: int) -> torch.Tensor:
    """w8g32's int8 tiles [T, K, 16] as w8a8's quads [T, Kp/4, 16, 4] (K zero-padded to whole
    groups of 32): one 64-byte line = 4 inputs x 16 channels, a channel's 4 inputs in one
    32-bit lane, what one vpdpbusd / vpmaddubsw takes."""
    t, kp = tiles.shape[0], -(-k // W8A8_GROUP) * W8A8_GROUP
    padded = torch.nn.functional.pad(tiles, (0, 0, 0, kp - k))
    return padded.view(t, kp // 4, 4, W8A8_TILE).permute(0, 1, 3, 2).contiguous()


class RowsLinear:
    """A packed weight one native kernel runs for every row count (decode and prefill alike):
    `__call__` hands it [rows, in] float32 (and a residual it can add as it stores), keeping
    any leading dimensions. Subclasses set `in_features`, `out_features`, `_nbytes` and
    supply `_matmul`: W8A8Linear here, quant_gguf.Q41A8Linear."""

    in_features: int
    out_features: int
    _nbytes: int

    @property
    def nbytes(self) -> int:
        """Bytes read per call: the packed weight (+ bias)."""
        return self._nbytes

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if _flat_rows(x, self.in_features):
            return self._matmul(x, residual)
        lead = x.shape[:-1]
        y = self._matmul(_rows(x, self.in_features).float(), _native_residual(x, residual))
        return y.reshape(*lead, self.out_features)


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
        from pdserve.engine import kernels

        self._ops = kernels.w8a8_module(isa)  # isa: "avx2" | "vnni"; None picks by the CPU
        w = weight.detach().float().contiguous()  # [in, out]
        self.in_features, self.out_features = w.shape
        tiles, self.scales = kernels.w8g32_module().pack(w)  # w8g32's rounding, its scales
        # The VNNI build's int8 activations take its weights offset by 128 (unsigned bytes: see
        # w8a8.cpp); int16 activations (W8A16Linear) take them as they are.
        self._offset = self._weight_offset()
        self.q = _quads(tiles, self.in_features) ^ (-self._offset)
        self.bias = None if bias is None else bias.detach().float().contiguous()
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
        y = self._ops.matmul(x, self.q, self.scales, self.out_features, self.bias, residual)
        return cast(torch.Tensor, y)


class W8A16Linear(W8A8Linear):
    """W8A8Linear's int8 weights (w8g32's rounding and scales) times int16 activations, one
    scale per 32 inputs per row (kernels/w8a8.cpp's matmul_a16): `gguf-a16`'s Q8_0 LM head.
    The input size must be a multiple of 32 (a GGUF block's)."""

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
        y = self._ops.matmul_a16(x, self.q, self.scales, self.out_features, self.bias, residual)
        return cast(torch.Tensor, y)


def decode_matmul(name: str, quantization: str, device: torch.device, dtype: torch.dtype) -> str:
    """What `--decode-matmul name` means for this engine: "tiles" or "torch".

    `tiles` needs float32 projection weights (`--quantization none`, `--dtype float32`) on a
    CPU the native kernel runs on; asked for elsewhere it is refused at start-up, never dropped
    silently. `auto` is tiles wherever it runs, torch elsewhere (quantized models, CUDA)."""
    if name not in DECODE_MATMULS:
        raise ValueError(f"decode_matmul must be one of {', '.join(DECODE_MATMULS)}, got {name!r}")
    if name == "torch":
        return "torch"
    from pdserve.engine import kernels

    why = (
        f"quantization {quantization!r} (tiles hold float32 weights)"
        if quantization != "none"
        else f"device {device}"
        if device.type != "cpu"
        else f"dtype {str(dtype).removeprefix('torch.')}"
        if dtype != torch.float32
        else f"a CPU without AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
        if not kernels.cpu_supported()
        else None
    )
    if why is None:
        return "tiles"
    if name == "tiles":
        raise ValueError(f"decode_matmul 'tiles' cannot run with {why}; use auto or torch")
    return "torch"


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
        from pdserve.engine import kernels

        self._ops = kernels.w8g32_module(isa)
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
        x2 = _rows(x, self.in_features)
        if x2.shape[0] <= self.rows:
            res = _native_residual(x, residual)
            y = self._ops.matmul_f32(x2, self.tiles, self.out_features, self.bias, res)
        elif self.bias is None:
            y = _add_residual(x2 @ self.weight, residual)
        else:
            y = _add_residual(torch.addmm(self.bias, x2, self.weight), residual)
        return y.reshape(*lead, self.out_features)


def tile_model(model: LlamaModel) -> None:
    """Give every float32 projection and the LM head its F32TileLinear (`decode_matmul`
    tiles); the float weights stay for prefill."""
    for layer in layers_of(model):
        for proj in projections_of(layer):
            bias = layer.qkv_bias if proj == "qkv" else None
            layer.quantized[proj] = F32TileLinear(getattr(layer, proj), bias)
    model.quantized_head = F32TileLinear(model.lm_head)


class FusedOps:
    """RMSNorm, RoPE and the MLP's silu(gate) * up as one native call each (kernels/w8g32.cpp)
    instead of torch's 3-8 small ops: at batch 1 those ops, ~60 norms, 30 RoPEs and 30
    activations a step, cost more than their math.
    Quantized (w8g32, w8a8) models only: the rounding differs slightly from torch's, and
    `--quantization none` keeps bit-exact parity with HF."""

    def __init__(self, isa: str | None = None) -> None:
        from pdserve.engine import kernels

        self._ops = kernels.w8g32_module(isa)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return cast(torch.Tensor, self._ops.rms_norm(x, weight, eps))

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        """silu(gate) * up for the gate|up output [T, 2 * intermediate], in one pass."""
        return cast(torch.Tensor, self._ops.silu_mul(gate_up, intermediate))

    def rope(
        self, x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> torch.Tensor:
        """[T, heads, D] from the first heads * D columns of x [T, *]; cos and signed_sin as
        RotaryEmbedding.cos_sin makes them ([T, 1, D])."""
        t = x.shape[0]
        return cast(torch.Tensor, self._ops.rope(x, heads, cos.view(t, -1), signed_sin.view(t, -1)))


_scratch_local = threading.local()


def _scratch(rows: int, cols: int) -> torch.Tensor:
    """A float32 [rows, cols] view of this thread's reused prefill scratch (one per thread, at
    most W8G32_SCRATCH floats plus a tile: every projection shares it, one call at a time)."""
    need = rows * cols
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < need:
        buf = torch.empty(need, dtype=torch.float32)
        _scratch_local.buf = buf
    return buf[:need].view(rows, cols)


def _use_fbgemm() -> None:
    """Pack with the x86 engine (fbgemm underneath); the packing is engine-specific."""
    engines = torch.backends.quantized.supported_engines
    torch.backends.quantized.engine = "x86" if "x86" in engines else "fbgemm"


# Projections `w8a8` keeps on float32 activations (W8G32Linear): q|k|v, whose input (the
# attention's RMSNorm output) was the one whose int8 rounding cost the most. Measured
# (docs/benchmarks/quant.md, 60 prompts x 64 tokens): with every projection's activations int8,
# 48.9% agreement with float32 and mean KL 4.5e-3, below llama.cpp's Q4_1 (49.3%, 3.1e-3);
# float32 activations for one projection at a time: qkv 54.3% / 3.2e-3, the others 43-49% /
# 3.8-4.2e-3. q|k|v is 16% of a layer's weights.
W8A8_FLOAT_ACTIVATIONS = ("qkv",)


def quantize(
    name: str, weight: torch.Tensor, bias: torch.Tensor | None = None, proj: str = ""
) -> Projection | None:
    """The quantized stand-in for a [in, out] weight, or None for `none` (keep the float);
    `proj` names the projection (a LAYER_PROJECTIONS name, "head" or "")."""
    if name == "none":
        return None
    if name == "int8":
        return Int8Linear(weight, bias)
    if name == "w8g32" or (name == "w8a8" and proj in W8A8_FLOAT_ACTIVATIONS):
        return W8G32Linear(weight, bias)
    if name == "w8a8":
        return W8A8Linear(weight, bias)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {name!r}")


def quantize_model(
    model: LlamaModel,
    name: str,
    head: bool = True,
    gguf: dict[str, GgufWeight] | None = None,
) -> None:
    """Replace every projection (and the LM head when `head`) by its quantized form, and free
    the float copies: a quantized model holds no float32 projection weights. `gguf` (the file's
    own tensors by HF name, quant_gguf.gguf_weights) is what `gguf` runs."""
    from pdserve.engine import quant_gguf

    if name == "none":
        return
    if name in quant_gguf.GGUF_QUANTIZATIONS and gguf is None:
        raise ValueError(f"quantization {name} runs a GGUF file's own weights; this model has none")
    for i, layer in enumerate(layers_of(model)):
        for proj in projections_of(layer):
            weight = getattr(layer, proj)
            bias = layer.qkv_bias if proj == "qkv" else None
            if gguf is not None:
                parts = [gguf[n] for n in file_tensor_names(model, i, proj)]
                acts = quant_gguf.activations_of(name, proj)
                quantized = quant_gguf.projection(parts, weight, bias, f"layer {i} {proj}", acts)
            else:
                quantized = quantize(name, weight, bias, proj)
            if quantized is not None:
                layer.quantized[proj] = cast(Projection, quantized)
                weight.data = weight.data.new_empty(0)
    if name in NATIVE_QUANTIZATIONS:
        fused = FusedOps()
        model.fused = fused
        for layer in layers_of(model):
            layer.fused = fused
    if head:
        if gguf is not None:
            parts = [gguf[n] for n in file_tensor_names(model, -1, "head")]
            acts = quant_gguf.activations_of(name, "head")
            found = quant_gguf.projection(parts, model.lm_head, None, "the LM head", acts)
            model.quantized_head = cast("Projection | None", found)
        else:
            model.quantized_head = quantize(name, model.lm_head, proj="head")
        if model.quantized_head is not None:
            model.lm_head.data = model.lm_head.data.new_empty(0)


def file_tensor_names(model: LlamaModel, layer: int, proj: str) -> list[str]:
    """The HF tensor names a fused projection is made of, in the order they are fused."""
    if proj == "head":
        tied = model.arch.tie_word_embeddings
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
    return {
        "qkv": [a + f"{n}_proj.weight" for n in "qkv"],
        "o": [a + "o_proj.weight"],
        "gate_up": [m + "gate_proj.weight", m + "up_proj.weight"],
        "down": [m + "down_proj.weight"],
    }[proj]


def projection_bytes(model: LlamaModel) -> int:
    """Bytes of projection weights + LM head that one step reads, as stored (quantized or not);
    of a mixture of experts, every expert's (a step reads those its tokens chose)."""
    total = 0
    for layer in layers_of(model):
        for proj in projections_of(layer):
            quantized = layer.quantized.get(proj)
            total += quantized.nbytes if quantized else getattr(layer, proj).nbytes
        total += layer.moe.nbytes if layer.moe is not None else 0
    head = model.quantized_head
    return total + (head.nbytes if head else model.lm_head.nbytes)


def projections_of(layer: LlamaLayer) -> tuple[str, ...]:
    """The layer's dense projections (LAYER_PROJECTIONS; ATTENTION_PROJECTIONS for a mixture of
    experts, whose experts engine/moe_quant.py quantizes)."""
    return LAYER_PROJECTIONS if layer.moe is None else ATTENTION_PROJECTIONS


def layers_of(model: LlamaModel) -> list[LlamaLayer]:
    return cast("list[LlamaLayer]", list(model.layers))
