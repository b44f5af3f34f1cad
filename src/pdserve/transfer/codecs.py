"""KV compression codecs for the P -> D wire: "none", "int8" and "int4".

A codec turns one layer's K (or V) for a token range, a tensor [n_tokens, kv_heads, head_dim],
into bytes and back. Its `encoded_size` is exact and depends only on the shape and dtype, so the
wire decoder can check a frame's `payload_len` before touching (or allocating for) the payload.

int8 / int4 are symmetric quantization with one float32 scale per (group, head), where a group is
`GROUP_TOKENS` consecutive tokens of the *encoded tensor* (group 0 starts at its first token).
Groups are not the paged-cache blocks: P and D may run different block sizes, so the wire speaks
in tokens only. Per-head scales matter because K magnitudes differ a lot between heads (a single
outlier head would otherwise crush the resolution of all others); per-group scales bound the cost
of a token outlier to its 16-token group. Payload layout: scales [groups, kv_heads] float32, then
the quantized values [n_tokens, kv_heads, head_dim] row-major (int8; or int4 as two's-complement
nibbles, element 2i in the low nibble of byte i, the last byte zero-padded).

Round trip: every element is within scale / 2 of the input (scale = absmax / 127 or / 7), plus
float rounding of the output dtype; an all-zero group has scale 0 and decodes to exact zeros.
NaN or infinite KV cannot be quantized (encode raises), and decode rejects a non-finite or
negative scale, so corruption never turns silently into NaN attention.
Everything is little-endian, so only little-endian hosts are supported (x86-64, ARM64).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod

import numpy as np
import torch

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError(
        "pdserve.transfer writes tensors' native bytes: it needs a little-endian host"
    )

GROUP_TOKENS = 16
SCALE_BYTES = 4  # float32

BytesLike = bytes | bytearray | memoryview

# Wire codes of the tensor dtypes (the frame header's `dtype` byte).
WIRE_DTYPES: dict[int, torch.dtype] = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
DTYPE_CODES: dict[torch.dtype, int] = {v: k for k, v in WIRE_DTYPES.items()}
# numpy has no bfloat16: its raw bytes travel as int16.
_NP_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "<f4",
    torch.bfloat16: "<i2",
    torch.float16: "<f2",
}


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODES:
        names = ", ".join(str(d) for d in DTYPE_CODES)
        raise ValueError(f"KV dtype {dtype} is not supported on the wire; use one of {names}")
    return DTYPE_CODES[dtype]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_input(x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"expected a [n_tokens, kv_heads, head_dim] tensor, got {tuple(x.shape)}")
    dtype_code(x.dtype)


def _check_length(buf: BytesLike, expected: int) -> memoryview:
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if view.nbytes != expected:
        raise ValueError(f"encoded KV has {view.nbytes} bytes, expected {expected}")
    return view


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's memory (no copy)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().reshape(-1).view(np.uint8).data


class KVCodec(ABC):
    name: str
    codec_id: int

    @abstractmethod
    def encoded_size(self, n_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Exact byte length of `encode` of such a tensor."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> memoryview:
        """Bytes of x [n_tokens, kv_heads, head_dim] (any device); may alias x's memory."""

    @abstractmethod
    def decode(
        self, buf: BytesLike, n_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """A new CPU tensor [n_tokens, kv_heads, head_dim] of `dtype`; ValueError if malformed."""


class RawCodec(KVCodec):
    """The tensor's own bytes. On a contiguous CPU tensor `encode` copies nothing: the frame
    part aliases the tensor, which must stay unmodified until the frame is sent."""

    name, codec_id = "none", 0

    def encoded_size(self, n_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        dtype_code(dtype)
        return n_tokens * kv_heads * head_dim * dtype.itemsize

    def encode(self, x: torch.Tensor) -> memoryview:
        _check_input(x)
        return _as_bytes(x.detach().cpu())

    def decode(
        self, buf: BytesLike, n_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        view = _check_length(buf, self.encoded_size(n_tokens, kv_heads, head_dim, dtype))
        values = np.frombuffer(view, dtype=_NP_DTYPES[dtype])
        # Zero-copy when the received buffer allows it (the receiver's only copy is then the
        # store into its KV blocks); torch needs aligned, writable memory, else copy.
        if view.readonly or values.ctypes.data % values.itemsize:
            values = values.copy()
        out = torch.from_numpy(values)
        if dtype == torch.bfloat16:
            out = out.view(torch.bfloat16)
        return out.view(n_tokens, kv_heads, head_dim)


class QuantCodec(KVCodec):
    """Symmetric per-(16-token group, head) quantization to `bits` bits (8 or 4)."""

    def __init__(self, name: str, codec_id: int, bits: int) -> None:
        self.name, self.codec_id, self.bits = name, codec_id, bits
        self.qmax = 2 ** (bits - 1) - 1  # 127 or 7: the range is symmetric, -128 / -8 unused

    def _data_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else _cdiv(numel, 2)

    def encoded_size(self, n_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        dtype_code(dtype)
        scales = _cdiv(n_tokens, GROUP_TOKENS) * kv_heads * SCALE_BYTES
        return scales + self._data_bytes(n_tokens * kv_heads * head_dim)

    def encode(self, x: torch.Tensor) -> memoryview:
        _check_input(x)
        scale, q = self.quantize(x.detach())
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"KV holds NaN or infinity: {self.name} cannot encode it")
        n, heads, dim = x.shape
        out = torch.empty(self.encoded_size(n, heads, dim, x.dtype), dtype=torch.uint8)
        split = scale.numel() * SCALE_BYTES
        out[:split].view(torch.float32).copy_(scale.flatten())
        out[split:].copy_(q.flatten().view(torch.uint8) if self.bits == 8 else _pack_nibbles(q))
        return out.numpy().data

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales [groups, kv_heads] float32 and values [n_tokens, kv_heads, head_dim] int8."""
        n, heads, _ = x.shape
        groups = _cdiv(n, GROUP_TOKENS)
        xf = x.float()
        token_absmax = xf.abs().amax(dim=2) if xf.numel() else xf.new_zeros(n, heads)
        padded = torch.nn.functional.pad(token_absmax, (0, 0, 0, groups * GROUP_TOKENS - n))
        scale = padded.view(groups, GROUP_TOKENS, heads).amax(dim=1) / self.qmax
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero group -> zeros
        q = xf / _per_token(divisor, n)[:, :, None]
        return scale, q.round_().clamp_(-self.qmax, self.qmax).to(torch.int8)

    def decode(
        self, buf: BytesLike, n_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        view = _check_length(buf, self.encoded_size(n_tokens, kv_heads, head_dim, dtype))
        groups = _cdiv(n_tokens, GROUP_TOKENS)
        scale = _read_scales(view, groups * kv_heads).view(groups, kv_heads)
        data = np.frombuffer(view, dtype=np.uint8, offset=scale.numel() * SCALE_BYTES).copy()
        numel = n_tokens * kv_heads * head_dim
        raw = torch.from_numpy(data)
        q = raw.view(torch.int8) if self.bits == 8 else _unpack_nibbles(raw, numel)
        values = q.view(n_tokens, kv_heads, head_dim).float()
        return (values * _per_token(scale, n_tokens)[:, :, None]).to(dtype)


def _per_token(per_group: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """[groups, heads] -> [n_tokens, heads]: each group's row repeated for its tokens."""
    return per_group.repeat_interleave(GROUP_TOKENS, dim=0)[:n_tokens]


def _read_scales(view: memoryview, count: int) -> torch.Tensor:
    scales = np.frombuffer(view, dtype="<f4", count=count).copy()
    if not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise ValueError("encoded KV has a negative, NaN or infinite scale")
    return torch.from_numpy(scales)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] -> uint8 bytes, two's-complement nibbles, low nibble first."""
    flat = q.flatten().to(torch.int16)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.view(-1, 2) & 0xF
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def _unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """uint8 bytes -> the first `numel` nibbles as signed int8 in [-8, 7]."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=1).flatten()[:numel]
    return ((nibbles ^ 8).to(torch.int8)) - 8


CODECS: dict[str, KVCodec] = {
    "none": RawCodec(),
    "int8": QuantCodec("int8", 1, 8),
    "int4": QuantCodec("int4", 2, 4),
}
CODECS_BY_ID: dict[int, KVCodec] = {c.codec_id: c for c in CODECS.values()}


def get_codec(name: str) -> KVCodec:
    if name not in CODECS:
        raise ValueError(f"unknown KV codec {name!r}; choose one of {', '.join(CODECS)}")
    return CODECS[name]
