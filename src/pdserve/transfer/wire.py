"""The KV frame: one request's KV for a layer range and a token range, as bytes, version 1.

Why this shape:
  * Token ranges, not block ids: P and D have their own block pools and may even use different
    block sizes, so block ids mean nothing across the wire. D maps [token_start, token_end) onto
    its own block table. Layer ranges let P stream a prompt layer by layer (or chunk by chunk)
    while the rest is still being computed.
  * A fixed little-endian header (`struct`), then the payload: for each layer, K then V, each
    `codec.encode`d. `encode_frame` returns the header and the payload parts separately, so a
    sender can scatter them (zmq multipart, `socket.sendmsg`) without concatenating; a "none"
    frame of contiguous CPU tensors copies no tensor data at all.
  * The decoder trusts nothing: every length is checked against the exact size the header
    implies (`codec.encoded_size`) and against `max_payload` before any tensor is allocated, and
    a CRC-32 over the header and payload catches corruption (every single-bit flip, any burst up
    to 32 bits). CRC-32 is not a MAC: it guards against accidents, not against an attacker.
  * `fingerprint` is 8 bytes of sha256 over the KV layout (layers, KV heads, head dim, dtype,
    and a model's sliding windows: `kv_layout.KVLayout.fingerprint`), independent of the model's
    name, so P and D serving the same model agree and a frame for a different layout is
    rejected. It cannot tell two fine-tunes of one architecture apart (workers add the weights'
    identity for that).
  * Sliding windows: a sliding-window layer's frames cover only what D's first query there can
    see, tokens [num_kv - window + 1, num_kv) (`ModelArch.kv_needed_from`, computed alike on
    both sides from the arch), so the frame itself is unchanged and its version too; what
    changed is which ranges a sender sends, which the layout fingerprint names instead.

Header (little-endian, `HEADER_FIXED_SIZE` = 50 bytes, then the request id):
  magic b"PDKV" | version u16 | header_len u16 | codec u8 | dtype u8 | flags u16 (0 in v1) |
  layer_start u16 | layer_end u16 | token_start u32 | token_end u32 | kv_heads u16 |
  head_dim u16 | fingerprint 8s | payload_len u64 | checksum u32 | request_id_len u16 |
  request id (UTF-8, <= 256 bytes)
`header_len` = 50 + request_id_len: the payload starts there. `checksum` = CRC-32C (v2; v1 used
zlib's CRC-32, 3x slower here, and its frames still decode) of the
header with the checksum field zeroed, continued over the payload.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import crc32c
import torch

from pdserve.kv_layout import FINGERPRINT_BYTES
from pdserve.transfer.codecs import (
    CODECS_BY_ID,
    WIRE_DTYPES,
    BytesLike,
    dtype_code,
    get_codec,
)

MAGIC = b"PDKV"
VERSION = 2  # v2: CRC-32C (hardware, ~3x zlib's CRC-32 here); v1 frames (zlib CRC-32) still decode
READABLE_VERSIONS = (1, 2)
MAX_REQUEST_ID_BYTES = 256
DEFAULT_MAX_PAYLOAD = 1 << 30

_FIXED = struct.Struct("<4sHHBBHHHIIHH8sQIH")
HEADER_FIXED_SIZE = _FIXED.size
_CRC_OFFSET = struct.calcsize("<4sHHBBHHHIIHH8sQ")
_U16, _U32 = 0xFFFF, 0xFFFFFFFF

Part = bytes | memoryview


class WireError(ValueError):
    """A frame that is malformed, corrupt, too large, or for another KV layout."""


@dataclass(frozen=True)
class FrameHeader:
    version: int
    header_len: int
    codec: int  # codec id, see `codecs.CODECS`
    dtype: int  # 0 float32, 1 bfloat16, 2 float16
    flags: int
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    kv_heads: int
    head_dim: int
    fingerprint: bytes
    payload_len: int
    checksum: int
    request_id: str = ""

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def codec_name(self) -> str:
        return CODECS_BY_ID[self.codec].name

    @property
    def torch_dtype(self) -> torch.dtype:
        return WIRE_DTYPES[self.dtype]

    def tensor_size(self) -> int:
        """Encoded bytes of one K (or V) tensor of one layer."""
        codec = CODECS_BY_ID[self.codec]
        return codec.encoded_size(self.num_tokens, self.kv_heads, self.head_dim, self.torch_dtype)

    def pack(self) -> bytes:
        rid = self.request_id.encode()
        return _FIXED.pack(
            MAGIC, self.version, self.header_len, self.codec, self.dtype, self.flags,
            self.layer_start, self.layer_end, self.token_start, self.token_end,
            self.kv_heads, self.head_dim, self.fingerprint, self.payload_len, self.checksum,
            len(rid),
        ) + rid  # fmt: skip


@dataclass(frozen=True)
class Frame:
    """A checked frame; `layers()` decodes one layer at a time from the received buffers.

    The payload stays in the buffers it arrived in (`segments`, in order): a tensor that lies
    inside one segment is decoded from it directly, without joining the frame first.
    """

    header: FrameHeader
    segments: tuple[memoryview, ...]

    @property
    def request_id(self) -> str:
        return self.header.request_id

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens

    def layers(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(layer index, K, V) per layer, [num_tokens, heads, dim]; for codec "none" these may
        be views of the received buffers, valid while those are."""
        size = self.header.tensor_size()
        for i in range(self.header.num_layers):
            offset = 2 * i * size
            k = self._decode(self._slice(offset, size))
            v = self._decode(self._slice(offset + size, size))
            yield self.header.layer_start + i, k, v

    def _slice(self, offset: int, size: int) -> memoryview:
        """Bytes [offset, offset + size) of the payload; a copy only if they span segments."""
        pieces: list[memoryview] = []
        need = size
        for seg in self.segments:
            if offset >= len(seg):
                offset -= len(seg)
                continue
            piece = seg[offset : offset + need]
            pieces.append(piece)
            need -= len(piece)
            offset = 0
            if need == 0:
                break
        return pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))

    def _decode(self, buf: memoryview) -> torch.Tensor:
        h = self.header
        try:
            return CODECS_BY_ID[h.codec].decode(
                buf, h.num_tokens, h.kv_heads, h.head_dim, h.torch_dtype
            )
        except ValueError as e:
            raise WireError(f"bad payload: {e}") from e


# --------------------------------------------------------------------------- encode


def encode_frame(
    request_id: str,
    layer_start: int,
    token_start: int,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    codec: str,
    fingerprint: bytes,
) -> list[bytes | memoryview]:
    """[header, K0, V0, K1, V1, ...]: keys[i]/values[i] are layer `layer_start + i`."""
    kv = get_codec(codec)
    n_tokens, heads, dim, dtype = _check_tensors(keys, values)
    parts: list[Part] = [kv.encode(t) for pair in zip(keys, values, strict=True) for t in pair]
    header = FrameHeader(
        version=VERSION,
        header_len=HEADER_FIXED_SIZE + len(request_id.encode()),
        codec=kv.codec_id,
        dtype=dtype_code(dtype),
        flags=0,
        layer_start=layer_start,
        layer_end=layer_start + len(keys),
        token_start=token_start,
        token_end=token_start + n_tokens,
        kv_heads=heads,
        head_dim=dim,
        fingerprint=fingerprint,
        payload_len=frame_nbytes(parts),
        checksum=0,
        request_id=request_id,
    )
    _check_encodable(header)
    header = replace(header, checksum=_checksum(header.pack(), parts))
    return [header.pack(), *parts]


def _check_tensors(
    keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> tuple[int, int, int, torch.dtype]:
    if not keys or len(keys) != len(values):
        raise ValueError(f"need as many K as V tensors (>= 1), got {len(keys)} and {len(values)}")
    first = keys[0]
    for t in (*keys, *values):
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError("every K and V tensor must share one shape and dtype")
    if first.dim() != 3 or first.shape[0] < 1:
        raise ValueError(f"expected [n_tokens >= 1, kv_heads, head_dim], got {tuple(first.shape)}")
    n, heads, dim = first.shape
    return n, heads, dim, first.dtype


def _check_encodable(h: FrameHeader) -> None:
    limits = {
        "layer_end": (h.layer_end, _U16),
        "token_end": (h.token_end, _U32),
        "kv_heads": (h.kv_heads, _U16),
        "head_dim": (h.head_dim, _U16),
    }
    for name, (value, top) in limits.items():
        if not 0 < value <= top:
            raise ValueError(f"{name} = {value} does not fit the frame header (max {top})")
    if h.layer_start < 0 or h.token_start < 0:
        raise ValueError("layer_start and token_start must be >= 0")
    if h.header_len - HEADER_FIXED_SIZE > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request id longer than {MAX_REQUEST_ID_BYTES} UTF-8 bytes")
    if len(h.fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes")


def _checksum(header: bytes, payload: Sequence[BytesLike], version: int = VERSION) -> int:
    """CRC over the header (its checksum field counted as zero) and the payload, in place."""
    crc_fn = _crc32c if version >= 2 else zlib.crc32
    crc = crc_fn(header[:_CRC_OFFSET])
    crc = crc_fn(bytes(4), crc)
    crc = crc_fn(header[_CRC_OFFSET + 4 :], crc)
    for part in payload:
        crc = crc_fn(part, crc)
    return crc


def _crc32c(data: BytesLike, value: int = 0) -> int:
    return int(crc32c.crc32c(data, value=value))


def frame_nbytes(parts: Sequence[BytesLike]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


# --------------------------------------------------------------------------- decode


def peek_header(
    data: BytesLike | Sequence[BytesLike], *, max_payload: int = DEFAULT_MAX_PAYLOAD
) -> FrameHeader:
    """The checked header, for routing; needs only the header's bytes (the checksum, which
    covers the payload, is left to `decode_frame`)."""
    return _parse_header(_head(data), max_payload)


def decode_frame(
    data: BytesLike | Sequence[BytesLike],
    *,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    fingerprint: bytes | None = None,
) -> Frame:
    """Check a whole frame (one buffer or its parts in order); raises WireError only.

    The parts are not joined: the checksum runs over them in place and the payload is decoded
    from them, so a received frame is read once for the checksum and once to store it."""
    views = [_as_view(p) for p in _split(data)]
    head = _head(views)
    header = _parse_header(head, max_payload)
    total = sum(len(v) for v in views)
    if total != header.header_len + header.payload_len:
        raise WireError(
            f"frame has {total} bytes, header says {header.header_len + header.payload_len}"
        )
    segments = tuple(_skip(views, header.header_len))
    if _checksum(bytes(head[: header.header_len]), segments, header.version) != header.checksum:
        raise WireError("checksum mismatch: the frame is corrupt")
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise WireError(
            f"KV layout fingerprint {header.fingerprint.hex()} != expected {fingerprint.hex()}: "
            "P and D serve different model layouts or KV dtypes"
        )
    return Frame(header, segments)


def _skip(views: list[memoryview], n: int) -> Iterator[memoryview]:
    """The views after their first `n` bytes, empty ones dropped."""
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        yield v[n:]
        n = 0


def _as_view(data: object) -> memoryview:
    try:
        view = memoryview(data)  # type: ignore[arg-type]
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as e:
        raise WireError(f"not a byte buffer: {type(data).__name__}") from e


def _split(data: object) -> list[object]:
    """A frame given as one buffer or as its parts (any buffers, in order) -> the parts."""
    if isinstance(data, bytes | bytearray | memoryview) or not isinstance(data, Sequence):
        return [data]
    return list(data)


def _head(data: object) -> memoryview:
    """The first bytes of a frame, enough for any header, without joining a whole payload."""
    head, need = bytearray(), HEADER_FIXED_SIZE + MAX_REQUEST_ID_BYTES
    for part in _split(data):
        head += _as_view(part)[: need - len(head)]
        if len(head) >= need:
            break
    return memoryview(bytes(head))


def _parse_header(buf: memoryview, max_payload: int) -> FrameHeader:
    if len(buf) < HEADER_FIXED_SIZE:
        raise WireError(f"short frame: {len(buf)} bytes, the header alone is {HEADER_FIXED_SIZE}")
    magic, *fields, rid_len = _FIXED.unpack_from(buf)
    header = FrameHeader(*fields)  # the request id is read once header_len is checked
    _check_preamble(magic, header, rid_len)
    if len(buf) < header.header_len:
        raise WireError(f"short frame: {len(buf)} bytes, the header is {header.header_len}")
    header = replace(header, request_id=_request_id(buf[HEADER_FIXED_SIZE : header.header_len]))
    _check_layout(header)
    _check_payload_len(header, max_payload)
    return header


def _check_preamble(magic: bytes, h: FrameHeader, rid_len: int) -> None:
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: not a pdserve KV frame")
    if h.version not in READABLE_VERSIONS:
        raise WireError(
            f"unknown frame version {h.version}; this build reads versions {READABLE_VERSIONS}"
        )
    if h.flags != 0:
        raise WireError(f"flags must be 0 in version {VERSION}, got {h.flags:#x}")
    if rid_len > MAX_REQUEST_ID_BYTES:
        raise WireError(f"request id of {rid_len} bytes (max {MAX_REQUEST_ID_BYTES})")
    if h.header_len != HEADER_FIXED_SIZE + rid_len:
        raise WireError(f"header_len {h.header_len} != {HEADER_FIXED_SIZE} + request id {rid_len}")


def _request_id(raw: memoryview) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise WireError("request id is not valid UTF-8") from e


def _check_layout(h: FrameHeader) -> None:
    if h.codec not in CODECS_BY_ID:
        raise WireError(f"unknown codec id {h.codec}; known: {sorted(CODECS_BY_ID)}")
    if h.dtype not in WIRE_DTYPES:
        raise WireError(f"unknown dtype code {h.dtype}; known: {sorted(WIRE_DTYPES)}")
    if h.layer_end <= h.layer_start:
        raise WireError(f"empty layer range [{h.layer_start}, {h.layer_end})")
    if h.token_end <= h.token_start:
        raise WireError(f"empty token range [{h.token_start}, {h.token_end})")
    if h.kv_heads == 0 or h.head_dim == 0:
        raise WireError(f"kv_heads ({h.kv_heads}) and head_dim ({h.head_dim}) must be > 0")


def _check_payload_len(h: FrameHeader, max_payload: int) -> None:
    if h.payload_len > max_payload:
        raise WireError(f"payload of {h.payload_len} bytes exceeds max_payload {max_payload}")
    expected = 2 * h.num_layers * h.tensor_size()
    if h.payload_len != expected:
        raise WireError(
            f"payload_len {h.payload_len} != {expected} bytes implied by the header "
            f"({h.num_layers} layers x K,V of {h.num_tokens} tokens, codec {h.codec_name})"
        )
