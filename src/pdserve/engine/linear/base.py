"""The projection interface and what its native implementations share: the two call paths
(`StreamedLinear`, `RowsLinear`), the prefill scratch, and the fused element-wise ops."""

from __future__ import annotations

import threading
from typing import Protocol, cast

import torch

from pdserve.engine import kernels


class Projection(Protocol):
    """y = x @ W (+ bias) (+ residual), W [in, out]: how a layer runs one of its weight
    matrices. `residual` (x's rows by W's outputs) is added last, as torch's
    `residual + (x @ W + bias)` would: native kernels add it as they store their output."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


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


def gemv_rows(isa: str) -> int:
    """Most rows the streaming kernel takes for this build on this CPU (see above)."""
    if kernels.cpu_vendor() == "GenuineIntel":
        return W8G32_GEMV_ROWS
    return W8G32_GEMV_ROWS_NOT_INTEL.get(isa, W8G32_GEMV_ROWS)


def float_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias as the native kernels read it: float32, contiguous."""
    return None if bias is None else bias.detach().float().contiguous()


def add_residual(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """y + residual in y's storage (the same values as `residual + y`), for the paths whose
    kernel does not add it."""
    return y if residual is None else y.add_(residual)


def native_residual(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
    """The residual as a native kernel takes it ([rows, out] float32), when x is 2-D as the
    layers pass it; None when there is none. A kernel refuses any other shape."""
    if residual is not None and x.dim() != 2:
        raise ValueError(f"a residual needs a 2-D input, got {tuple(x.shape)}")
    return residual


def flat_rows(x: torch.Tensor, in_features: int) -> bool:
    """x is float32 [rows, in_features], as the layers pass it: the kernel takes it as it is
    (a step's four reshapes, dtype checks and calls per projection cost ~0.5 ms at batch 1)."""
    return x.dim() == 2 and x.shape[1] == in_features and x.dtype == torch.float32


def as_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as [rows, in_features] (a view where it can be), or a clear error for another width."""
    if x.shape[-1] != in_features:
        raise ValueError(f"input has {x.shape[-1]} features, weight takes {in_features}")
    return x.reshape(-1, in_features)


class StreamedLinear:
    """A packed weight that a native kernel streams for up to `gemv_rows()` rows (decode) and
    dequantizes in column chunks for torch's GEMM past that (prefill): w8g32's int8
    (w8g32.W8G32Linear) and gguf's Q4_1 (gguf.Q41Linear). A subclass packs its weight and
    calls `_setup`; it supplies the kernel's matmul and dequantize calls."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None

    def _setup(
        self,
        packed: tuple[torch.Tensor, ...],
        bias: torch.Tensor | None,
        scratch_floats: int,
        isa: str,
    ) -> None:
        """`packed`: the tensors a decode call reads (codes, scales, ...); `isa`: the kernel
        build's, which sets how many rows it streams."""
        self.bias = float_bias(bias)
        self._nbytes = sum(t.nbytes for t in packed) + (
            0 if self.bias is None else self.bias.nbytes
        )
        self._gemv_rows = gemv_rows(isa)
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
        if flat_rows(x, self.in_features) and x.shape[0] <= self._gemv_rows:
            return self._matmul(x, residual)
        lead = x.shape[:-1]
        x2 = as_rows(x, self.in_features).float()
        if x2.shape[0] <= self._gemv_rows:
            y = self._matmul(x2, native_residual(x, residual))
        else:
            y = add_residual(self._prefill(x2), residual)
        return y.reshape(*lead, self.out_features)

    def _prefill(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        if self._chunk >= n:
            w = self._dequantize(0, n, scratch(self.in_features, n))
            return x @ w if self.bias is None else torch.addmm(self.bias, x, w)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        for n0 in range(0, n, self._chunk):
            n1 = min(n, n0 + self._chunk)
            w = self._dequantize(n0, n1, scratch(self.in_features, n1 - n0))
            y[:, n0:n1] = x @ w if self.bias is None else torch.addmm(self.bias[n0:n1], x, w)
        return y


class RowsLinear:
    """A packed weight one native kernel runs for every row count (decode and prefill alike):
    `__call__` hands it [rows, in] float32 (and a residual it can add as it stores), keeping
    any leading dimensions. Subclasses set `in_features`, `out_features`, `_nbytes` and
    supply `_matmul`: w8a8.W8A8Linear, gguf.Q41A8Linear."""

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
        if flat_rows(x, self.in_features):
            return self._matmul(x, residual)
        lead = x.shape[:-1]
        y = self._matmul(as_rows(x, self.in_features).float(), native_residual(x, residual))
        return y.reshape(*lead, self.out_features)


class FusedKernel(Protocol):
    """kernels/w8g32.cpp's element-wise calls."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor: ...

    def rope(
        self, x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> torch.Tensor: ...


class FusedOps:
    """RMSNorm, RoPE and the MLP's silu(gate) * up as one native call each (kernels/w8g32.cpp)
    instead of torch's 3-8 small ops: at batch 1 those ops, ~60 norms, 30 RoPEs and 30
    activations a step, cost more than their math.
    Quantized (w8g32, w8a8) models only: the rounding differs slightly from torch's, and
    `--quantization none` keeps bit-exact parity with HF."""

    def __init__(self, isa: str | None = None) -> None:
        self._ops = cast(FusedKernel, kernels.load("w8g32", isa))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._ops.rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        """silu(gate) * up for the gate|up output [T, 2 * intermediate], in one pass."""
        return self._ops.silu_mul(gate_up, intermediate)

    def rope(
        self, x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> torch.Tensor:
        """[T, heads, D] from the first heads * D columns of x [T, *]; cos and signed_sin as
        RotaryEmbedding.cos_sin makes them ([T, 1, D])."""
        t = x.shape[0]
        return self._ops.rope(x, heads, cos.view(t, -1), signed_sin.view(t, -1))


_scratch_local = threading.local()


def scratch(rows: int, cols: int) -> torch.Tensor:
    """A float32 [rows, cols] view of this thread's reused prefill scratch (one per thread, as
    large as the largest chunk asked for: every projection shares it, one call at a time)."""
    need = rows * cols
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < need:
        buf = torch.empty(need, dtype=torch.float32)
        _scratch_local.buf = buf
    return buf[:need].view(rows, cols)
