"""Security fuzzing of the KV frame decoder: whatever bytes arrive, `decode_frame` (and then
`Frame.layers()`) and `peek_header` give a checked frame or raise `WireError` — never another
exception, never a tensor of the wrong shape, never an allocation the header merely claims.

Inputs: arbitrary bytes (one buffer or several parts); mutations of valid frames of every codec
and dtype, as sent (the CRC catches them) and re-checksummed (so the structure checks and the
codecs see them); single corrupted payload bytes; header size fields that lie.
Deterministic (`derandomize=True`, no example database) and sized to run in a few seconds.
"""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from typing import Any

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.transfer.codecs import CODECS, CODECS_BY_ID, WIRE_DTYPES
from pdserve.transfer.wire import (
    DEFAULT_MAX_PAYLOAD,
    HEADER_FIXED_SIZE,
    MAX_REQUEST_ID_BYTES,
    Frame,
    WireError,
    decode_frame,
    encode_frame,
    peek_header,
)

# The header layout as specified (see test_wire.py), independent of the implementation.
SPEC = struct.Struct("<4sHHBBHHHIIHH8sQIH")
CRC_AT = struct.calcsize("<4sHHBBHHHIIHH8sQ")
FIELDS = [
    "magic", "version", "header_len", "codec", "dtype", "flags", "layer_start", "layer_end",
    "token_start", "token_end", "kv_heads", "head_dim", "fingerprint", "payload_len", "checksum",
    "request_id_len",
]  # fmt: skip
FP = b"fp-8byte"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

BASE = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def fuzz(n: int) -> settings:
    return settings(BASE, max_examples=n)


_FRAMES: dict[tuple[Any, ...], bytes] = {}


def make_frame(
    codec: str = "int8",
    dtype: torch.dtype = torch.float32,
    n: int = 3,
    layers: int = 2,
    heads: int = 2,
    dim: int = 4,
    rid: str = "req-1",
) -> bytes:
    key = (codec, dtype, n, layers, heads, dim, rid)
    if key not in _FRAMES:
        gen = torch.Generator().manual_seed(n * 31 + layers)
        kv = [torch.randn(n, heads, dim, generator=gen).to(dtype) for _ in range(2 * layers)]
        parts = encode_frame(rid, 3, 17, kv[:layers], kv[layers:], codec, FP)
        _FRAMES[key] = b"".join(bytes(p) for p in parts)
    return _FRAMES[key]


frames = st.builds(
    make_frame,
    codec=st.sampled_from(list(CODECS)),
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 20),
    layers=st.integers(1, 2),
    heads=st.integers(1, 2),
    dim=st.integers(1, 5),
    rid=st.sampled_from(["r", "req-é", "x" * MAX_REQUEST_ID_BYTES, ""]),
)


def rechecksum(data: bytes) -> bytes:
    """The CRC fixed per the spec for the version and header_len the bytes claim, so that a
    mutation reaches the checks behind the checksum. Too-short input is returned as is."""
    if len(data) < HEADER_FIXED_SIZE:
        return data
    version, header_len = struct.unpack_from("<HH", data, 4)
    head_end = min(header_len, len(data))
    crc_fn = zlib.crc32 if version == 1 else (lambda b, v=0: int(crc32c.crc32c(b, value=v)))
    crc = crc_fn(data[:CRC_AT])
    crc = crc_fn(bytes(4), crc)
    crc = crc_fn(data[CRC_AT + 4 : head_end], crc)
    crc = crc_fn(data[head_end:], crc)
    return data[:CRC_AT] + struct.pack("<I", crc) + data[CRC_AT + 4 :]


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def decode_or_none(data: Any, **kwargs: Any) -> Frame | None:
    """decode_frame(data) with every layer decoded, or None for a WireError; any other exception
    fails the test. peek_header agrees with it (or raises WireError, or is stricter)."""
    try:
        peeked = peek_header(data, max_payload=kwargs.get("max_payload", DEFAULT_MAX_PAYLOAD))
    except WireError:
        peeked = None
    try:
        frame = decode_frame(data, **kwargs)
        layers = list(frame.layers())
    except WireError as e:
        assert isinstance(e, ValueError)
        return None
    h = frame.header
    assert peeked == h
    assert len(layers) == h.num_layers == h.layer_end - h.layer_start > 0
    for i, (index, k, v) in enumerate(layers):
        assert index == h.layer_start + i
        for t in (k, v):
            assert t.shape == (h.num_tokens, h.kv_heads, h.head_dim)
            assert t.dtype == h.torch_dtype
    return frame


# ---- arbitrary bytes -----------------------------------------------------------------------------
@fuzz(400)
@given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=3))
def test_arbitrary_bytes(data: bytes, cuts: list[int]) -> None:
    assert decode_or_none(data) is None
    assert decode_or_none(split(data, cuts)) is None


def _mostly(draw: st.DrawFn, good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> Any:
    """`good` seven times in eight: each check is passed often enough to reach the next."""
    return draw(bad) if draw(st.integers(0, 7)) == 0 else draw(good)


@st.composite
def random_frames(draw: st.DrawFn) -> bytes:
    """Header fields drawn from their whole ranges (plausible values most of the time), a
    request id, a payload of random bytes (often exactly the size the header implies), and a
    valid checksum: random input that reaches the layout checks and the codecs."""
    u16, u32 = st.integers(0, 0xFFFF), st.integers(0, 2**32 - 1)
    layer_start = _mostly(draw, st.integers(0, 40), u16)
    token_start = _mostly(draw, st.integers(0, 40), u32)
    h: dict[str, Any] = {
        "magic": b"PDKV",
        "version": _mostly(draw, st.sampled_from([1, 2]), u16),
        "codec": _mostly(draw, st.sampled_from(sorted(CODECS_BY_ID)), st.integers(0, 0xFF)),
        "dtype": _mostly(draw, st.sampled_from(sorted(WIRE_DTYPES)), st.integers(0, 0xFF)),
        "flags": _mostly(draw, st.just(0), u16),
        "layer_start": layer_start,
        "layer_end": _mostly(draw, st.integers(1, 3).map(lambda k: layer_start + k), u16),
        "token_start": token_start,
        "token_end": _mostly(draw, st.integers(1, 40).map(lambda k: token_start + k), u32),
        "kv_heads": _mostly(draw, st.integers(1, 4), u16),
        "head_dim": _mostly(draw, st.integers(1, 8), u16),
        "fingerprint": draw(st.binary(min_size=8, max_size=8)),
        "payload_len": 0,
        "checksum": 0,
    }
    h["layer_end"] = min(h["layer_end"], 0xFFFF)
    h["token_end"] = min(h["token_end"], 2**32 - 1)
    rid = _mostly(draw, st.text(max_size=12).map(str.encode), st.binary(max_size=12))
    h["request_id_len"] = len(rid)
    h["header_len"] = _mostly(draw, st.just(HEADER_FIXED_SIZE + len(rid)), st.integers(0, 400))
    implied = None
    if h["codec"] in CODECS_BY_ID and h["dtype"] in WIRE_DTYPES:
        n, layers = h["token_end"] - h["token_start"], h["layer_end"] - h["layer_start"]
        if n > 0 and layers > 0:
            size = CODECS_BY_ID[h["codec"]].encoded_size(
                n, h["kv_heads"], h["head_dim"], WIRE_DTYPES[h["dtype"]]
            )
            implied = 2 * layers * size
    if implied is not None and implied <= 4096 and draw(st.integers(0, 3)):
        payload = draw(st.binary(min_size=implied, max_size=implied))
    else:
        payload = draw(st.binary(max_size=64))
    h["payload_len"] = draw(
        st.one_of(st.just(len(payload)), st.integers(0, 2**64 - 1))
        if implied is None
        else st.sampled_from([implied, len(payload)])
    )
    return rechecksum(SPEC.pack(*(h[f] for f in FIELDS)) + rid + payload)


@fuzz(400)
@given(random_frames(), st.lists(st.integers(0, 300), max_size=3))
def test_random_headers_and_payloads_with_valid_checksums(data: bytes, cuts: list[int]) -> None:
    out = decode_or_none(data)
    assert (decode_or_none(split(data, cuts)) is None) == (out is None)


# ---- mutations of valid frames -------------------------------------------------------------------
@st.composite
def mutated(draw: st.DrawFn, raw: bytes) -> bytes:
    buf = bytearray(raw)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "append"]))
        if kind == "append":
            buf += draw(st.binary(min_size=1, max_size=16))
        elif not buf:
            continue
        elif kind == "flip":
            bit = draw(st.integers(0, 8 * len(buf) - 1))
            buf[bit // 8] ^= 1 << (bit % 8)
        elif kind == "set":
            # the header is where the structure is: hit it more often than its share
            end = len(buf) - 1 if draw(st.booleans()) else min(len(buf) - 1, 80)
            buf[draw(st.integers(0, end))] = draw(st.integers(0, 255))
        elif kind == "insert":
            at = draw(st.integers(0, len(buf)))
            buf[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            at = draw(st.integers(0, len(buf) - 1))
            del buf[at : at + draw(st.integers(1, 4))]
        else:
            del buf[draw(st.integers(0, len(buf) - 1)) :]
    return bytes(buf)


@fuzz(300)
@given(frames, st.data())
def test_mutated_frames(raw: bytes, data: st.DataObject) -> None:
    bad = data.draw(mutated(raw))
    cuts = data.draw(st.lists(st.integers(0, len(bad)), max_size=3))
    out = decode_or_none(bad)
    assert out is None or bad == raw  # only a no-op mutation gets past the CRC
    assert (decode_or_none(split(bad, cuts)) is None) == (out is None)


@fuzz(300)
@given(frames, st.data())
def test_rechecksummed_mutated_frames(raw: bytes, data: st.DataObject) -> None:
    """Past the CRC: every structure check and codec sees the mutation; WireError or a frame
    whose layers all have the header's shape and dtype."""
    bad = rechecksum(data.draw(mutated(raw)))
    cuts = data.draw(st.lists(st.integers(0, len(bad)), max_size=3))
    out = decode_or_none(bad)
    assert (decode_or_none(split(bad, cuts)) is None) == (out is None)


@fuzz(200)
@given(frames, st.data())
def test_any_single_corrupted_payload_byte_is_rejected(raw: bytes, data: st.DataObject) -> None:
    header_len = peek_header(raw).header_len
    at = data.draw(st.integers(header_len, len(raw) - 1))
    bad = bytearray(raw)
    bad[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(WireError, match="checksum"):
        decode_frame(bytes(bad))
    with pytest.raises(WireError, match="checksum"):
        decode_frame(split(bytes(bad), [header_len, at]))


@fuzz(200)
@given(frames, st.data())
def test_any_single_corrupted_header_byte_is_rejected(raw: bytes, data: st.DataObject) -> None:
    at = data.draw(st.integers(0, peek_header(raw).header_len - 1))
    bad = bytearray(raw)
    bad[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(WireError):
        decode_frame(bytes(bad))


# ---- header size fields that lie -----------------------------------------------------------------
def patch(frame: bytes, **fields: Any) -> bytes:
    """Rewrite header fields (the request id and payload kept), the CRC fixed after."""
    values = dict(zip(FIELDS, SPEC.unpack_from(frame), strict=True))
    rest = frame[HEADER_FIXED_SIZE:]
    values.update(fields)
    return rechecksum(SPEC.pack(*values.values()) + rest)


LIES = {
    "payload_len": st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([2**30, 2**63, 2**64 - 1])),
    "token_end": st.integers(18, 2**32 - 1),
    "layer_end": st.integers(4, 2**16 - 1),
    "kv_heads": st.integers(1, 2**16 - 1),
    "head_dim": st.integers(1, 2**16 - 1),
}
ID_LIES = {  # drawn less often: they are refused before the sizes are looked at
    "request_id_len": st.integers(0, 2**16 - 1),
    "header_len": st.integers(0, 2**16 - 1),
}


@fuzz(300)
@given(
    raw=frames,
    lies=st.fixed_dictionaries({}, optional=LIES).filter(bool),
    id_lies=st.one_of(st.just({}), st.fixed_dictionaries({}, optional=ID_LIES)),
    consistent=st.booleans(),
    max_payload=st.sampled_from([1 << 30, 1 << 62]),
)
def test_lying_size_fields_are_rejected_without_allocating(
    raw: bytes, lies: dict[str, int], id_lies: dict[str, int], consistent: bool, max_payload: int
) -> None:
    """Sizes claiming up to 2**64 bytes against a buffer of a few hundred: a WireError, and
    the decoder allocates nothing near what the header claims."""
    bad = patch(raw, **lies, **id_lies)
    h = dict(zip(FIELDS, SPEC.unpack_from(bad), strict=True))
    if consistent and "payload_len" not in lies:
        # payload_len agreeing with the lying shape, so only the buffer's length contradicts it
        codec = list(CODECS.values())[h["codec"]]
        size = codec.encoded_size(
            max(h["token_end"] - h["token_start"], 0),
            h["kv_heads"],
            h["head_dim"],
            DTYPES[h["dtype"]],
        )
        bad = patch(
            bad, payload_len=min(2 * max(h["layer_end"] - h["layer_start"], 0) * size, 2**64 - 1)
        )
    tracemalloc.start()
    try:
        out = decode_or_none(bad, max_payload=max_payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoding {len(bad)} bytes allocated {peak} bytes"
    if out is not None:  # only a lie that happens to tell the truth
        assert len(bad) == out.header.header_len + out.header.payload_len


@pytest.mark.parametrize("codec", list(CODECS))
def test_a_header_claiming_the_largest_frame_fails_fast(codec: str) -> None:
    raw = make_frame(codec)
    biggest = dict(token_start=0, token_end=2**32 - 1, layer_start=0, layer_end=2**16 - 1,
                   kv_heads=2**16 - 1, head_dim=2**16 - 1)  # fmt: skip
    for payload_len in (0, 2**40, 2**64 - 1):
        bad = patch(raw, payload_len=payload_len, **biggest)
        tracemalloc.start()
        try:
            with pytest.raises(WireError):
                decode_frame(bad, max_payload=2**64 - 1)
            with pytest.raises(WireError):
                decode_frame([bad[:HEADER_FIXED_SIZE], bad[HEADER_FIXED_SIZE:]], max_payload=2**63)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20
