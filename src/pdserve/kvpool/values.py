"""The one stored value format of every tier: one *chunk* of consecutive blocks of a chain,
self-describing and checksummed.

    header  magic b"PDKVPOOL", version u16, codec id u8, dtype code u8, tokens u32 (the block
            size), layers u16, kv_heads u16, head_dim u16, key length u16, payload length u64,
            first u32 (the chunk's first block's position in its chain), blocks u16
            (little-endian)
    key     the full pool key (namespace digest + chained hash of the chunk's LAST block), echoed
    payload the chunk [blocks, layers, 2, tokens, kv_heads, head_dim] through the namespace's codec
    crc     crc32c (u32) of everything before it

`decode_value` checks all of it against the key, first block and block count asked for: a value
of another namespace or chunk layout, a truncated file, a flipped bit or an unknown version
raises `CorruptValue` and is never served. Version 1 (one block per value, no first/blocks)
is refused like any unknown version; its keys live under another namespace digest
(`PoolNamespace.digest`), so a version-2 pool never even asks for them - they are a miss that
ages out of the tiers' LRU, not an error.
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
VERSION = 2
_HEADER = struct.Struct("<8sHBBIHHHHQIH")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size


class CorruptValue(ValueError):
    """A stored value that does not verify: the caller deletes it and recomputes."""


def _slices(kv: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a codec encodes, [n_tokens, kv_heads, head_dim] each.

    A quantizing codec's scale groups are GROUP_TOKENS tokens: when the block size is a multiple
    of it, the whole chunk goes at once (no group crosses a block or layer); else each
    (block, layer, K|V) slice goes alone so no scale is shared between them."""
    blocks, layers, two, tokens, heads, dim = kv.shape
    if tokens % GROUP_TOKENS == 0:
        return [kv.reshape(blocks * layers * two * tokens, heads, dim)]
    return [kv[b, layer, i] for b in range(blocks) for layer in range(layers) for i in range(two)]


def _payload_size(codec: KVCodec, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    blocks, layers, two, tokens, heads, dim = shape
    if tokens % GROUP_TOKENS == 0:
        return codec.encoded_size(blocks * layers * two * tokens, heads, dim, dtype)
    return blocks * layers * two * codec.encoded_size(tokens, heads, dim, dtype)


def encode_value(key: bytes, kv: torch.Tensor, first: int, codec_name: str) -> bytes:
    """The stored bytes of a chunk kv [blocks, layers, 2, tokens, kv_heads, head_dim] (CPU)
    whose first block is block `first` of its chain."""
    if kv.dim() != 6 or kv.shape[2] != 2 or not 0 < kv.shape[0] < 1 << 16:
        raise ValueError(
            "a pool chunk is [blocks, layers, 2, block_size, kv_heads, head_dim], got "
            f"{tuple(kv.shape)}"
        )
    if not 0 <= first < 1 << 32:
        raise ValueError(f"a chunk's first block position must be in [0, 2**32), got {first}")
    codec = get_codec(codec_name)
    blocks, layers, _, tokens, heads, dim = kv.shape
    size = _payload_size(codec, tuple(kv.shape), kv.dtype)
    header = _HEADER.pack(
        MAGIC, VERSION, codec.codec_id, dtype_code(kv.dtype), tokens, layers, heads, dim,
        len(key), size, first, blocks,
    )  # fmt: skip
    parts: list[BytesLike] = [header, key, *(codec.encode(p) for p in _slices(kv))]
    crc = 0
    for part in parts:
        crc = crc32c.crc32c(part, value=crc)
    return b"".join([*parts, _CRC.pack(crc)])  # the one copy (raw payloads alias kv)


def decode_value(key: bytes, value: BytesLike, first: int, blocks: int) -> torch.Tensor:
    """The chunk [blocks, layers, 2, tokens, heads, dim] stored in `value` under `key`, which
    must start at block `first` and hold `blocks` blocks; CorruptValue unless every check
    passes."""
    view = memoryview(value).cast("B")
    if view.nbytes < HEADER_BYTES + _CRC.size:
        raise CorruptValue(f"value of {view.nbytes} bytes is shorter than a header")
    magic, version, codec_id, dcode, tokens, layers, heads, dim, key_len, size, *rest = (
        _HEADER.unpack_from(view)
    )
    v_first, v_blocks = rest
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
    if (v_first, v_blocks) != (first, blocks):
        raise CorruptValue(
            f"the value holds blocks {v_first}..{v_first + v_blocks - 1}, the key names "
            f"{first}..{first + blocks - 1}"
        )
    codec, dtype = CODECS_BY_ID[codec_id], WIRE_DTYPES[dcode]
    shape = (blocks, layers, 2, tokens, heads, dim)
    if _payload_size(codec, shape, dtype) != size:
        raise CorruptValue("payload length does not match the header's shape")
    try:
        return _decode_payload(codec, view[HEADER_BYTES + key_len : end], shape, dtype)
    except ValueError as e:  # e.g. a NaN scale under a valid checksum (a buggy writer)
        raise CorruptValue(f"payload does not decode: {e}") from e


def _decode_payload(
    codec: KVCodec, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    blocks, layers, two, tokens, heads, dim = shape
    if tokens % GROUP_TOKENS == 0:
        # A new tensor: decode copies out of read-only bytes (RawCodec) or dequantizes.
        rows = blocks * layers * two * tokens
        return codec.decode(payload, rows, heads, dim, dtype).reshape(shape)
    step = codec.encoded_size(tokens, heads, dim, dtype)
    parts = [
        codec.decode(payload[i * step : (i + 1) * step], tokens, heads, dim, dtype)
        for i in range(blocks * layers * two)
    ]
    return torch.stack(parts).reshape(shape)


def value_nbytes(
    key_len: int, shape: tuple[int, ...], dtype: torch.dtype, codec: str, blocks: int = 1
) -> int:
    """The stored size of a chunk of `blocks` blocks of `shape` [layers, 2, tokens, heads, dim]
    (capacity planning, the chunk size, benchmarks)."""
    payload = _payload_size(get_codec(codec), (blocks, *shape), dtype)
    return HEADER_BYTES + key_len + payload + _CRC.size
