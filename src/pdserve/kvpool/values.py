"""The one stored value format of every tier: one block's KV, self-describing and checksummed.

    header  magic b"PDKVPOOL", version u16, codec id u8, dtype code u8, tokens u32, layers u16,
            kv_heads u16, head_dim u16, key length u16, payload length u64   (little-endian)
    key     the full pool key (namespace digest + block hash), echoed
    payload the block [layers, 2, tokens, kv_heads, head_dim] through the namespace's codec
    crc     crc32c (u32) of everything before it

`decode_value` checks all of it against the key asked for: a value of another namespace, a
truncated file, a flipped bit or an unknown version raises `CorruptValue` and is never served.
"""

from __future__ import annotations

import struct

import crc32c
import torch

from pdserve.transfer.codecs import (
    CODECS_BY_ID,
    GROUP_TOKENS,
    WIRE_DTYPES,
    BytesLike,
    KVCodec,
    dtype_code,
    get_codec,
)

MAGIC = b"PDKVPOOL"
VERSION = 1
_HEADER = struct.Struct("<8sHBBIHHHHQ")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size


class CorruptValue(ValueError):
    """A stored value that does not verify: the caller deletes it and recomputes."""


def _slices(kv: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a codec encodes, [n_tokens, kv_heads, head_dim] each.

    A quantizing codec's scale groups are GROUP_TOKENS tokens: when the block size is a multiple
    of it, the whole block goes at once (no group crosses a layer); else each (layer, K|V) slice
    goes alone so no scale is shared between layers."""
    layers, two, tokens, heads, dim = kv.shape
    if tokens % GROUP_TOKENS == 0:
        return [kv.reshape(layers * two * tokens, heads, dim)]
    return [kv[layer, i] for layer in range(layers) for i in range(two)]


def _payload_size(codec: KVCodec, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    layers, two, tokens, heads, dim = shape
    if tokens % GROUP_TOKENS == 0:
        return codec.encoded_size(layers * two * tokens, heads, dim, dtype)
    return layers * two * codec.encoded_size(tokens, heads, dim, dtype)


def encode_value(key: bytes, kv: torch.Tensor, codec_name: str) -> bytes:
    """The stored bytes of one block kv [layers, 2, tokens, kv_heads, head_dim] (CPU)."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(
            f"a pool block is [layers, 2, block_size, kv_heads, head_dim], got {tuple(kv.shape)}"
        )
    codec = get_codec(codec_name)
    layers, _, tokens, heads, dim = kv.shape
    size = _payload_size(codec, tuple(kv.shape), kv.dtype)
    header = _HEADER.pack(
        MAGIC, VERSION, codec.codec_id, dtype_code(kv.dtype), tokens, layers, heads, dim,
        len(key), size,
    )  # fmt: skip
    parts: list[BytesLike] = [header, key, *(codec.encode(p) for p in _slices(kv))]
    crc = 0
    for part in parts:
        crc = crc32c.crc32c(part, value=crc)
    return b"".join([*parts, _CRC.pack(crc)])  # the one copy (raw payloads alias kv)


def decode_value(key: bytes, value: BytesLike) -> torch.Tensor:
    """The block stored in `value` under `key`; CorruptValue unless every check passes."""
    view = memoryview(value).cast("B")
    if view.nbytes < HEADER_BYTES + _CRC.size:
        raise CorruptValue(f"value of {view.nbytes} bytes is shorter than a header")
    magic, version, codec_id, dcode, tokens, layers, heads, dim, key_len, size = (
        _HEADER.unpack_from(view)
    )
    if magic != MAGIC or version != VERSION:
        raise CorruptValue(f"not a pool value of version {VERSION} (magic {magic!r} v{version})")
    if bytes(view[HEADER_BYTES : HEADER_BYTES + key_len]) != key:
        raise CorruptValue("the value echoes another key")
    end = HEADER_BYTES + key_len + size
    if view.nbytes != end + _CRC.size:
        raise CorruptValue(f"value has {view.nbytes} bytes, its header says {end + _CRC.size}")
    (crc,) = _CRC.unpack_from(view, end)
    if crc32c.crc32c(view[:end]) != crc:
        raise CorruptValue("checksum mismatch")
    if codec_id not in CODECS_BY_ID or dcode not in WIRE_DTYPES:
        raise CorruptValue(f"unknown codec {codec_id} or dtype {dcode}")
    codec, dtype = CODECS_BY_ID[codec_id], WIRE_DTYPES[dcode]
    shape = (layers, 2, tokens, heads, dim)
    if _payload_size(codec, shape, dtype) != size:
        raise CorruptValue("payload length does not match the header's shape")
    try:
        return _decode_payload(codec, view[HEADER_BYTES + key_len : end], shape, dtype)
    except ValueError as e:  # e.g. a NaN scale under a valid checksum (a buggy writer)
        raise CorruptValue(f"payload does not decode: {e}") from e


def _decode_payload(
    codec: KVCodec, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    layers, two, tokens, heads, dim = shape
    if tokens % GROUP_TOKENS == 0:
        # A new tensor: decode copies out of read-only bytes (RawCodec) or dequantizes.
        return codec.decode(payload, layers * two * tokens, heads, dim, dtype).reshape(shape)
    step = codec.encoded_size(tokens, heads, dim, dtype)
    parts = [
        codec.decode(payload[i * step : (i + 1) * step], tokens, heads, dim, dtype)
        for i in range(layers * two)
    ]
    return torch.stack(parts).reshape(shape)


def value_nbytes(key_len: int, shape: tuple[int, ...], dtype: torch.dtype, codec: str) -> int:
    """The stored size of one block (for capacity planning and benchmarks)."""
    return HEADER_BYTES + key_len + _payload_size(get_codec(codec), shape, dtype) + _CRC.size
