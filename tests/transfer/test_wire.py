"""KV wire frames: round trips, the v1 goldens, and a decoder that rejects bad input with
WireError only (structure checks, exact lengths, max_payload, checksum, fingerprint, fuzzing)."""

from __future__ import annotations

import hashlib
import importlib.util
import struct
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.models.arch import ModelArch
from pdserve.kv_layout import KVLayout
from pdserve.transfer.codecs import CODECS, GROUP_TOKENS
from pdserve.transfer.wire import (
    HEADER_FIXED_SIZE,
    Frame,
    FrameHeader,
    WireError,
    decode_frame,
    encode_frame,
    frame_nbytes,
    peek_header,
)

# The v1 header exactly as specified, independently of the implementation's own struct.
SPEC = struct.Struct("<4sHHBBHHHIIHH8sQIH")
FIELDS = [
    "magic", "version", "header_len", "codec", "dtype", "flags", "layer_start", "layer_end",
    "token_start", "token_end", "kv_heads", "head_dim", "fingerprint", "payload_len", "checksum",
    "request_id_len",
]  # fmt: skip
FP = b"fp-8byte"
GOLDEN = Path(__file__).parent / "golden"


def _crc32c(data: bytes, value: int = 0) -> int:
    return int(crc32c.crc32c(data, value=value))


def _frame(codec: str = "int8", n: int = 3, layers: int = 2, rid: str = "req-1") -> bytes:
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(n, 2, 4, generator=gen) for _ in range(layers)]
    values = [torch.randn(n, 2, 4, generator=gen) for _ in range(layers)]
    return b"".join(encode_frame(rid, 4, 32, keys, values, codec, FP))


def _patch(
    frame: bytes, rid: bytes | None = None, payload: bytes | None = None, **fields: Any
) -> bytes:
    """Rewrite header fields (and optionally the request id / payload), then fix the checksum
    unless `checksum` is given: so each check is reached on its own, past the CRC."""
    values = dict(zip(FIELDS, SPEC.unpack_from(frame), strict=True))
    old_rid_end = values["header_len"]
    rid = frame[HEADER_FIXED_SIZE:old_rid_end] if rid is None else rid
    payload = frame[old_rid_end:] if payload is None else payload
    values.update(checksum=0, request_id_len=len(rid), header_len=HEADER_FIXED_SIZE + len(rid))
    values.update(fields)
    head = SPEC.pack(*values.values()) + rid
    if "checksum" not in fields:
        crc_fn = zlib.crc32 if values["version"] == 1 else _crc32c  # per the spec, not the code
        crc = crc_fn(payload, crc_fn(head))
        head = SPEC.pack(*{**values, "checksum": crc}.values()) + rid
    return head + payload


# --------------------------------------------------------------------------- round trips


@settings(max_examples=30, deadline=None)
@given(
    codec=st.sampled_from(list(CODECS)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    n=st.integers(1, 40),
    layers=st.integers(1, 3),
    heads=st.integers(1, 4),
    dim=st.integers(1, 8),
    layer_start=st.integers(0, 100),
    token_start=st.integers(0, 10_000),
    seed=st.integers(0, 2**31),
)
def test_round_trip(
    codec: str, dtype: torch.dtype, n: int, layers: int, heads: int, dim: int,
    layer_start: int, token_start: int, seed: int,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, heads, dim, generator=gen).to(dtype) for _ in range(layers)]
    values = [torch.randn(n, heads, dim, generator=gen).to(dtype) for _ in range(layers)]
    parts = encode_frame("r-é", layer_start, token_start, keys, values, codec, FP)
    assert len(parts) == 1 + 2 * layers
    joined = b"".join(parts)
    assert frame_nbytes(parts) == len(joined)
    for data in (parts, joined, memoryview(joined), bytearray(joined)):
        frame = decode_frame(data, fingerprint=FP)
        _check_frame(frame, keys, values, layer_start, token_start, codec)
    assert peek_header(parts[0]) == peek_header(joined) == frame.header


def _check_frame(
    frame: Frame, keys: list[torch.Tensor], values: list[torch.Tensor],
    layer_start: int, token_start: int, codec: str,
) -> None:  # fmt: skip
    h = frame.header
    n = keys[0].shape[0]
    assert (frame.request_id, frame.num_tokens, h.codec_name) == ("r-é", n, codec)
    assert (h.layer_start, h.layer_end) == (layer_start, layer_start + len(keys))
    assert (h.token_start, h.token_end) == (token_start, token_start + n)
    decoded = list(frame.layers())
    assert [i for i, _, _ in decoded] == list(range(layer_start, layer_start + len(keys)))
    for (_, k, v), k0, v0 in zip(decoded, keys, values, strict=True):
        for got, want in ((k, k0), (v, v0)):
            assert got.dtype == want.dtype and got.shape == want.shape
            _assert_close(got, want, codec)


def _assert_close(got: torch.Tensor, want: torch.Tensor, codec: str) -> None:
    if codec == "none":
        assert torch.equal(got, want)
        return
    qmax = 127 if codec == "int8" else 7
    # Per-(group, head) bound, loosened to the tensor's absmax: scale / 2 + output rounding.
    bound = want.float().abs().max() / qmax / 2 * 1.001 + want.float().abs().max() * 2.0**-8
    assert (got.float() - want.float()).abs().max() <= bound


def test_encode_frame_layout_header_then_k_v_per_layer() -> None:
    keys = [torch.full((2, 1, 2), float(i)) for i in range(3)]
    values = [torch.full((2, 1, 2), -float(i)) for i in range(3)]
    parts = encode_frame("abc", 7, 100, keys, values, "none", FP)
    assert len(parts[0]) == HEADER_FIXED_SIZE + 3
    header = dict(zip(FIELDS, SPEC.unpack_from(parts[0]), strict=True))
    assert header["magic"] == b"PDKV" and header["version"] == 2 and header["flags"] == 0
    assert (header["layer_start"], header["layer_end"]) == (7, 10)
    assert (header["token_start"], header["token_end"]) == (100, 102)
    assert header["payload_len"] == 3 * 2 * 2 * 2 * 4
    assert parts[0][HEADER_FIXED_SIZE:] == b"abc"
    assert bytes(parts[3]) == struct.pack("<4f", 1, 1, 1, 1)  # K of the second layer
    assert bytes(parts[4]) == struct.pack("<4f", -1, -1, -1, -1)


def test_encode_frame_rejects_bad_arguments() -> None:
    t = torch.zeros(2, 1, 2)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"keys": [], "values": []}, ">= 1"),
        ({"values": [t, t]}, ">= 1"),
        ({"values": [torch.zeros(3, 1, 2)]}, "share one shape"),
        ({"keys": [torch.zeros(0, 1, 2)], "values": [torch.zeros(0, 1, 2)]}, "n_tokens >= 1"),
        ({"codec": "zstd"}, "none, int8, int4"),
        ({"fingerprint": b"short"}, "8 bytes"),
        ({"request_id": "é" * 129}, "256"),
        ({"layer_start": 65535}, "layer_end"),
        ({"token_start": -1}, ">= 0"),
        ({"token_start": 2**32 - 2}, "token_end"),
    ]
    base: dict[str, Any] = dict(request_id="r", layer_start=0, token_start=0, keys=[t],
                                values=[t], codec="none", fingerprint=FP)  # fmt: skip
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            encode_frame(**{**base, **change})


# --------------------------------------------------------------------------- goldens


def _make_golden() -> ModuleType:
    path = Path(__file__).with_name("make_golden.py")
    spec = importlib.util.spec_from_file_location("make_golden", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name", ["kv_frame_v2.bin", "kv_frame_v2_none.bin", "kv_frame_v1.bin", "kv_frame_v1_none.bin"]
)
def test_golden_frame_decodes_and_re_encodes_byte_for_byte(name: str) -> None:
    mg = _make_golden()
    data = (GOLDEN / name).read_bytes()
    version = 1 if "_v1" in name else 2
    assert data[:8] == b"PDKV" + struct.pack("<HH", version, HEADER_FIXED_SIZE + 12)
    fingerprint = layout_fingerprint(mg.ARCH, torch.float32)
    frame = decode_frame(data, fingerprint=fingerprint)
    h = frame.header
    codec = {**mg.GOLDENS, **mg.V1_GOLDENS}[name]
    assert (frame.request_id, h.codec_name) == (mg.REQUEST_ID, codec)
    assert h.torch_dtype == torch.float32
    assert (h.layer_start, h.layer_end, h.token_start, h.token_end) == (0, 2, 16, 21)
    assert (h.kv_heads, h.head_dim) == (3, 4)
    keys, values = mg.golden_inputs()
    for (i, k, v), k0, v0 in zip(frame.layers(), keys, values, strict=True):
        _assert_close(k, k0, h.codec_name)
        _assert_close(v, v0, h.codec_name)
        if i == 1:
            assert torch.equal(k[:, 2], torch.zeros(5, 4))  # the all-zero head, scale 0
    if version == 2:  # the encoder writes the current version only; v1 stays readable
        assert mg.golden_frame(codec) == data


def test_golden_int8_values_are_the_quantized_inputs() -> None:
    frame = decode_frame((GOLDEN / "kv_frame_v2.bin").read_bytes())
    _, k0, _ = next(frame.layers())
    # Layer 0 K = (arange - 30) / 8: head 0 holds -30/8 .. -19/8 ... absmax of head 0 is 30/8.
    scale = (30 / 8) / 127
    assert k0[0, 0, 0].item() == pytest.approx(-127 * scale)
    assert k0[0, 0, 1].item() == pytest.approx(round((-29 / 8) / scale) * scale)


# --------------------------------------------------------------------------- fingerprint


def layout_fingerprint(arch: ModelArch, dtype: torch.dtype) -> bytes:
    return arch.kv_layout(dtype).fingerprint()


def _arch(**overrides: Any) -> ModelArch:
    base: dict[str, Any] = dict(architecture="llama", vocab_size=100, hidden_size=576,
                                intermediate_size=1536, num_layers=30, num_heads=9,
                                num_kv_heads=3, head_dim=64, name="SmolLM2")  # fmt: skip
    return ModelArch(**{**base, **overrides})


def test_fingerprint_depends_on_the_kv_layout_only() -> None:
    fp = layout_fingerprint(_arch(), torch.float32)
    assert len(fp) == 8
    same = [_arch(name="other", vocab_size=7, hidden_size=64, architecture="qwen2")]
    assert all(layout_fingerprint(a, torch.float32) == fp for a in same)
    different = [_arch(num_layers=24), _arch(num_kv_heads=4), _arch(head_dim=128)]
    assert all(layout_fingerprint(a, torch.float32) != fp for a in different)
    assert layout_fingerprint(_arch(), torch.bfloat16) != fp


def test_the_layout_names_the_weights_and_sizes_a_block() -> None:
    layout = _arch().kv_layout(torch.float32)
    assert layout == KVLayout(30, 3, 64, torch.float32)
    assert KVLayout(30, 3, 64, torch.float32, weights="w").fingerprint() != layout.fingerprint()
    assert layout.block_shape(16) == (30, 2, 16, 3, 64)
    assert layout.block_nbytes(16) == 30 * 2 * 16 * 3 * 64 * 4


def test_fingerprint_names_the_sliding_windows() -> None:
    """The window changes every later layer's KV and which tokens a hand-off sends a sliding
    layer (its window only): a P and a D that disagree on it must not pair."""
    plain = layout_fingerprint(_arch(), torch.float32)
    mistral = _arch(sliding_window=16, layer_types=("sliding",) * 30)
    mixed = _arch(sliding_window=16, layer_types=("sliding", "full") * 15)
    fps = {plain, *(layout_fingerprint(a, torch.float32) for a in (mistral, mixed))}
    assert len(fps) == 3
    wider = _arch(sliding_window=32, layer_types=("sliding",) * 30)
    assert layout_fingerprint(wider, torch.float32) != layout_fingerprint(mistral, torch.float32)
    unused = _arch(sliding_window=16)  # a window the config switches off (Qwen2.5)
    assert layout_fingerprint(unused, torch.float32) == plain


def test_the_fingerprint_text_is_a_wire_format() -> None:
    """Workers of different builds pair only if they hash the same text: pinned here."""
    mixed = _arch(sliding_window=16, layer_types=("sliding", "full") * 15)
    text = "pdkv-layout/1 layers=30 kv_heads=3 head_dim=64 dtype=float32"
    window = f" window=16 layers={'sf' * 15} window-kv/1"
    for arch, tail in ((_arch(), ""), (mixed, window)):
        pinned = hashlib.sha256((text + tail).encode()).digest()[:8]
        assert layout_fingerprint(arch, torch.float32) == pinned


def test_fingerprint_mismatch_is_rejected() -> None:
    data = _frame()
    assert decode_frame(data, fingerprint=FP).header.fingerprint == FP
    with pytest.raises(WireError, match="fingerprint"):
        decode_frame(data, fingerprint=b"other-fp")


# --------------------------------------------------------------------------- rejections


def test_max_payload_is_enforced_before_anything_is_decoded() -> None:
    data = _frame()
    payload_len = peek_header(data).payload_len
    assert decode_frame(data, max_payload=payload_len).header.payload_len == payload_len
    with pytest.raises(WireError, match="max_payload"):
        decode_frame(data, max_payload=payload_len - 1)
    with pytest.raises(WireError, match="max_payload"):
        peek_header(data[: HEADER_FIXED_SIZE + 5], max_payload=payload_len - 1)
    huge = _patch(data, payload_len=2**63, token_end=2**32 - 1, kv_heads=65535, head_dim=65535)
    with pytest.raises(WireError, match="max_payload"):
        decode_frame(huge)


REJECTIONS: list[tuple[dict[str, Any], str]] = [
    ({"magic": b"PDKX"}, "magic"),
    ({"version": 3}, "version"),
    ({"flags": 1}, "flags"),
    ({"header_len": HEADER_FIXED_SIZE + 4}, "header_len"),
    ({"codec": 3}, "codec"),
    ({"dtype": 3}, "dtype"),
    ({"layer_end": 4}, "empty layer range"),
    ({"layer_start": 9}, "empty layer range"),
    ({"token_end": 31}, "empty token range"),
    ({"kv_heads": 0}, "kv_heads"),
    ({"head_dim": 0}, "head_dim"),
    ({"payload_len": 1}, "implied by the header"),
    ({"codec": 0}, "implied by the header"),  # int8 payload read as "none"
    ({"token_end": 36}, "implied by the header"),
    ({"checksum": 12345}, "checksum"),
    ({"request_id_len": 257, "header_len": HEADER_FIXED_SIZE + 257}, "request id of 257"),
]


@pytest.mark.parametrize(("fields", "message"), REJECTIONS)
def test_each_header_check_rejects_with_wire_error(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode_frame(_patch(_frame(), **fields))


def test_request_id_must_be_utf8_and_at_most_256_bytes() -> None:
    with pytest.raises(WireError, match="UTF-8"):
        decode_frame(_patch(_frame(), rid=b"\xff\xfe"))
    assert decode_frame(_frame(rid="x" * 256)).request_id == "x" * 256
    with pytest.raises(WireError, match="request id"):
        decode_frame(_patch(_frame(), rid=b"x" * 257))


def test_payload_length_must_match_the_buffer_exactly() -> None:
    data = _frame()
    with pytest.raises(WireError, match="frame has"):
        decode_frame(data + b"\0")
    with pytest.raises(WireError, match="frame has"):
        decode_frame(data[:-1])


def test_a_payload_with_a_valid_checksum_but_corrupt_scales_is_a_wire_error() -> None:
    data = _frame("int8")
    start = peek_header(data).header_len
    payload = struct.pack("<f", float("nan")) + data[start + 4 :]  # the first scale
    frame = decode_frame(_patch(data, payload=payload))
    with pytest.raises(WireError, match="scale"):
        list(frame.layers())


@pytest.mark.parametrize("bad", [12345, "PDKV", [b"PDKV", 3], None, object()])
def test_non_buffers_are_wire_errors(bad: Any) -> None:
    with pytest.raises(WireError):
        decode_frame(bad)
    with pytest.raises(WireError):
        peek_header(bad)


# --------------------------------------------------------------------------- fuzzing


def test_every_truncation_is_rejected() -> None:
    data = _frame("int4", n=17)
    header_len = peek_header(data).header_len
    for end in range(len(data)):
        with pytest.raises(WireError):
            decode_frame(data[:end])
        if end < header_len:
            with pytest.raises(WireError):
                peek_header(data[:end])


def test_every_single_bit_flip_is_rejected() -> None:
    data = _frame("int8", n=2, layers=1)
    for bit in range(8 * len(data)):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(WireError):
            decode_frame(flipped)


@settings(max_examples=200, deadline=None)
@given(bit=st.integers(0, 8 * len(_frame("none", n=GROUP_TOKENS + 3)) - 1))
def test_bit_flips_in_a_larger_frame_are_rejected(bit: int) -> None:
    flipped = bytearray(_frame("none", n=GROUP_TOKENS + 3))
    flipped[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(WireError):
        decode_frame(flipped)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_are_rejected(data: bytes) -> None:
    with pytest.raises(WireError):
        decode_frame(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=HEADER_FIXED_SIZE - 6, max_size=400))
def test_random_bytes_after_a_valid_magic_and_version_are_rejected(tail: bytes) -> None:
    with pytest.raises(WireError):
        decode_frame(b"PDKV\x01\x00" + tail)


header_fields = st.sampled_from(
    [f for f in FIELDS if f not in ("magic", "fingerprint", "checksum")]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.dictionaries(header_fields, st.integers(0, 70_000), min_size=1, max_size=3))
def test_re_checksummed_header_edits_never_crash(changes: dict[str, int]) -> None:
    """Valid checksums over edited headers: WireError, or a frame that decodes completely."""
    widths = {"codec": 0xFF, "dtype": 0xFF, "token_start": 2**32 - 1, "token_end": 2**32 - 1}
    fields = {k: min(v, widths.get(k, 0xFFFF)) for k, v in changes.items()}
    data = _frame("int4", n=5)
    try:
        frame = decode_frame(_patch(data, **fields))
        layers = list(frame.layers())
    except WireError:
        return
    assert len(layers) == frame.header.num_layers
    assert all(k.shape == (frame.num_tokens, 2, 4) for _, k, _ in layers)


@settings(max_examples=100, deadline=None)
@given(codec=st.sampled_from(list(CODECS)), data=st.data())
def test_re_checksummed_random_payloads_never_crash(codec: str, data: st.DataObject) -> None:
    """Any payload bytes of the right length: WireError (bad scales) or finite-shape tensors."""
    frame_bytes = _frame(codec, n=5)
    size = peek_header(frame_bytes).payload_len
    payload = data.draw(st.binary(min_size=size, max_size=size))
    try:
        layers = list(decode_frame(_patch(frame_bytes, payload=payload)).layers())
    except WireError:
        return
    assert [k.shape for _, k, _ in layers] == [(5, 2, 4)] * 2


def test_header_dataclass_is_frozen() -> None:
    h = peek_header(_frame())
    assert isinstance(h, FrameHeader)
    with pytest.raises(AttributeError):
        h.flags = 1  # type: ignore[misc]
