"""The stored value format against its goldens; a decoder that trusts nothing."""

from __future__ import annotations

import struct
from pathlib import Path

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_golden import BLOCKS, CODECS, FIRST, GOLDEN_DIR, golden_block, golden_key
from pdserve.kvpool.values import HEADER_BYTES, VERSION, CorruptValue, decode_value, encode_value

OLD = GOLDEN_DIR / "value_v1_none.bin"  # a version-1 value (one block, no chunk fields)


def decode(key: bytes, value: bytes) -> torch.Tensor:
    return decode_value(key, value, FIRST, BLOCKS)


def _golden(codec: str) -> bytes:
    return (GOLDEN_DIR / f"value_v{VERSION}_{codec}.bin").read_bytes()


@pytest.mark.parametrize("codec", CODECS)
def test_encoding_matches_the_golden_byte_for_byte(codec: str) -> None:
    assert encode_value(golden_key(codec), golden_block(), FIRST, codec) == _golden(codec)


@pytest.mark.parametrize("codec", CODECS)
def test_the_golden_decodes(codec: str) -> None:
    got = decode(golden_key(codec), _golden(codec))
    want = golden_block()
    assert got.shape == want.shape and got.dtype == want.dtype
    if codec == "none":
        assert torch.equal(got, want)
    else:  # per (group, head) scale = absmax / 127: within half a step
        assert (got - want).abs().max() <= want.abs().max() / 127 / 2 + 1e-6


def test_every_truncation_is_refused() -> None:
    value, key = _golden("none"), golden_key("none")
    for n in range(len(value)):
        with pytest.raises(CorruptValue):
            decode(key, value[:n])
    with pytest.raises(CorruptValue):
        decode(key, value + b"\0")


def test_every_bit_flip_is_refused() -> None:
    value, key = bytearray(_golden("none")), golden_key("none")
    for i in range(len(value)):
        value[i] ^= 1 << (i % 8)
        with pytest.raises(CorruptValue):
            decode(key, bytes(value))
        value[i] ^= 1 << (i % 8)
    assert torch.equal(decode(key, bytes(value)), golden_block())


def test_another_key_or_version_is_refused() -> None:
    value, key = _golden("none"), golden_key("none")
    with pytest.raises(CorruptValue, match="another key"):
        decode(golden_key("int8"), value)  # same block, another namespace
    newer = bytearray(value)
    struct.pack_into("<H", newer, 8, VERSION + 1)
    with pytest.raises(CorruptValue, match="version"):
        decode(key, bytes(newer))
    assert len(struct.pack("<8sHBBIHHHHQIH", b"", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)) == HEADER_BYTES


def test_another_chunk_layout_is_refused() -> None:
    """The key names a chunk's last block; the reader also asks for its first block and count
    (another chunk size would put other blocks under the same key)."""
    value, key = _golden("none"), golden_key("none")
    with pytest.raises(CorruptValue, match=r"holds blocks 6\.\.7"):
        decode_value(key, value, FIRST - 1, BLOCKS + 1)
    with pytest.raises(CorruptValue, match="holds blocks"):
        decode_value(key, value, FIRST, BLOCKS - 1)


def test_a_version_1_value_is_refused() -> None:
    """Values of the per-block format (kept as a fixture) never decode as chunks. They are not
    even asked for: their keys are under another namespace digest (pdkvpool/1)."""
    with pytest.raises(CorruptValue, match="version"):
        decode_value(golden_key("none"), OLD.read_bytes(), 0, 1)


def test_encoding_refuses_what_it_cannot_store() -> None:
    with pytest.raises(ValueError, match="chunk"):
        encode_value(b"k", torch.zeros(1, 2, 3, 4, 2, 4), 0, "none")
    with pytest.raises(ValueError, match="chunk"):
        encode_value(b"k", torch.zeros(2, 2, 4, 2, 4), 0, "none")  # a block, not a chunk
    with pytest.raises(ValueError, match="first"):
        encode_value(b"k", torch.zeros(1, 1, 2, 16, 1, 4), -1, "none")
    with pytest.raises(ValueError, match="NaN"):
        encode_value(b"k", torch.full((1, 1, 2, 16, 1, 4), float("nan")), 0, "int8")
    with pytest.raises(ValueError, match="codec"):
        encode_value(b"k", torch.zeros(1, 1, 2, 16, 1, 4), 0, "zstd")


def _with_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", crc32c.crc32c(body))


def test_a_bad_scale_under_a_valid_checksum_is_corrupt() -> None:
    """A writer bug (a NaN scale, correctly checksummed) is CorruptValue, which the pool
    deletes and counts - not a ValueError escaping to the engine."""
    key, body = golden_key("int8"), bytearray(_golden("int8")[:-4])
    first_scale = HEADER_BYTES + len(key)
    struct.pack_into("<f", body, first_scale, float("nan"))
    with pytest.raises(CorruptValue, match="does not decode"):
        decode(key, _with_crc(bytes(body)))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_mutations_under_a_valid_checksum_are_refused_or_exact(data: st.DataObject) -> None:
    """Past the checksum (recomputed after the mutation), only CorruptValue or a tensor of the
    header's shape comes out: a buggy writer can never crash a reader."""
    codec = data.draw(st.sampled_from(CODECS))
    body = bytearray(_golden(codec)[:-4])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    try:
        out = decode(golden_key(codec), _with_crc(bytes(body)))
    except CorruptValue:
        return
    assert out.shape[:3] == (BLOCKS, 2, 2) and out.dim() == 6


def test_goldens_are_committed() -> None:
    assert sorted(p.name for p in Path(GOLDEN_DIR).glob("*.bin")) == [
        OLD.name,
        *(f"value_v{VERSION}_{c}.bin" for c in sorted(CODECS)),
    ]
