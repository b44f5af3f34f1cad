"""KV codecs: registry, exact sizes, round-trip error bounds, pinned byte layouts, bad input."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.transfer.codecs import CODECS, GROUP_TOKENS, QuantCodec, get_codec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Half an ulp of the output dtype, relative: decoding rounds q * scale to it once.
OUT_ROUNDING = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def test_registry_names_ids_and_lookup() -> None:
    assert {n: c.codec_id for n, c in CODECS.items()} == {"none": 0, "int8": 1, "int4": 2}
    assert get_codec("int8") is CODECS["int8"]
    with pytest.raises(ValueError, match="none, int8, int4"):
        get_codec("fp8")


def _random_kv(n: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Per-head magnitudes spanning 1000x, as real K heads do.
    head_scale = torch.logspace(-1, 2, heads)[None, :, None]
    return (torch.randn(n, heads, dim, generator=gen) * head_scale).to(dtype)


shapes = st.tuples(st.integers(1, 40), st.integers(1, 4), st.integers(1, 9))


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(list(CODECS)),
    dtype=st.sampled_from(DTYPES),
    shape=shapes,
    seed=st.integers(0, 2**31),
)
def test_round_trip_size_dtype_and_error_bound(
    name: str, dtype: torch.dtype, shape: tuple[int, int, int], seed: int
) -> None:
    codec = CODECS[name]
    x = _random_kv(*shape, dtype, seed)
    buf = codec.encode(x)
    assert len(buf) == codec.encoded_size(*shape, dtype)
    y = codec.decode(buf, *shape, dtype)
    assert y.shape == x.shape and y.dtype == dtype
    if isinstance(codec, QuantCodec):
        _assert_within_half_scale(codec, x, y)
    else:
        assert torch.equal(y, x)


def _assert_within_half_scale(codec: QuantCodec, x: torch.Tensor, y: torch.Tensor) -> None:
    scale, _ = codec.quantize(x)
    per_token = scale.repeat_interleave(GROUP_TOKENS, dim=0)[: x.shape[0], :, None]
    bound = per_token / 2 * (1 + 1e-5) + y.float().abs() * OUT_ROUNDING[x.dtype]
    err = (y.float() - x.float()).abs()
    assert (err <= bound).all(), float((err - bound).max())


def test_int8_error_is_at_most_half_a_step_per_element() -> None:
    x = _random_kv(37, 3, 64, torch.float32, seed=7)  # 3 groups, the last one partial
    codec = CODECS["int8"]
    assert isinstance(codec, QuantCodec)
    y = codec.decode(codec.encode(x), 37, 3, 64, torch.float32)
    scale, _ = codec.quantize(x)
    assert scale.shape == (3, 3)
    assert torch.allclose(scale[0], x[:16].abs().amax(dim=(0, 2)) / 127)
    _assert_within_half_scale(codec, x, y)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_zero_groups_round_trip_to_zeros(name: str) -> None:
    x = torch.zeros(20, 2, 4)
    x[16:, 1] = 3.0  # group 1, head 1 non-zero; everything else zero
    codec = CODECS[name]
    y = codec.decode(codec.encode(x), 20, 2, 4, torch.float32)
    assert torch.isfinite(y).all()
    assert torch.equal(y, x)


def test_scales_are_per_group_of_16_tokens_and_per_head() -> None:
    x = torch.ones(20, 2, 4)
    x[17, 0, 3] = 100.0  # an outlier in group 1, head 0
    codec = CODECS["int8"]
    assert isinstance(codec, QuantCodec)
    scale, _ = codec.quantize(x)
    assert torch.allclose(scale, torch.tensor([[1.0, 1.0], [100.0, 1.0]]) / 127)


def test_int8_bytes_are_scales_then_values() -> None:
    x = torch.tensor([[[127.0, -127.0, 3.0]]])
    assert bytes(CODECS["int8"].encode(x)) == struct.pack("<f", 1.0) + bytes([0x7F, 0x81, 0x03])


def test_int4_bytes_are_twos_complement_nibbles_low_first_last_byte_padded() -> None:
    x = torch.tensor([[[7.0, -7.0, 1.0, 0.0, -1.0]]])  # scale 7 / 7 = 1
    assert bytes(CODECS["int4"].encode(x)) == struct.pack("<f", 1.0) + bytes([0x97, 0x01, 0x0F])
    y = CODECS["int4"].decode(CODECS["int4"].encode(x), 1, 1, 5, torch.float32)
    assert torch.equal(y, x)


def test_none_is_the_raw_little_endian_bytes_and_bfloat16_works() -> None:
    x = torch.tensor([[[1.0, -2.0]]], dtype=torch.bfloat16)
    assert bytes(CODECS["none"].encode(x)) == bytes([0x80, 0x3F, 0x00, 0xC0])
    x32 = torch.tensor([[[1.0]]])
    assert bytes(CODECS["none"].encode(x32)) == struct.pack("<f", 1.0)


def test_none_encode_of_a_contiguous_cpu_tensor_copies_nothing() -> None:
    x = torch.zeros(2, 1, 2)
    buf = CODECS["none"].encode(x)
    x[1, 0, 1] = 5.0  # documented: the part aliases the tensor until sent
    assert CODECS["none"].decode(buf, 2, 1, 2, torch.float32)[1, 0, 1] == 5.0


def test_non_contiguous_input_is_encoded_in_logical_order() -> None:
    x = torch.arange(24, dtype=torch.float32).reshape(2, 4, 3).transpose(1, 2)  # [2, 3, 4]
    for codec in CODECS.values():
        y = codec.decode(codec.encode(x), 2, 3, 4, torch.float32)
        assert torch.allclose(y, x, atol=2.0)  # int4's step here is 23 / 7
    assert torch.equal(CODECS["none"].decode(CODECS["none"].encode(x), 2, 3, 4, x.dtype), x)


@pytest.mark.parametrize("name", list(CODECS))
def test_decode_rejects_wrong_lengths(name: str) -> None:
    codec = CODECS[name]
    buf = bytes(codec.encode(torch.ones(3, 2, 4)))
    for bad in (buf[:-1], buf + b"\0", b""):
        with pytest.raises(ValueError, match="expected"):
            codec.decode(bad, 3, 2, 4, torch.float32)


@pytest.mark.parametrize("bad_scale", [float("nan"), float("inf"), -1.0])
def test_decode_rejects_corrupt_scales(bad_scale: float) -> None:
    codec = CODECS["int8"]
    buf = bytearray(codec.encode(torch.ones(3, 1, 4)))
    buf[:4] = struct.pack("<f", bad_scale)
    with pytest.raises(ValueError, match="scale"):
        codec.decode(buf, 3, 1, 4, torch.float32)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantized_encode_rejects_non_finite_kv(name: str, bad: float) -> None:
    x = torch.ones(3, 2, 4)
    x[1, 1, 2] = bad
    with pytest.raises(ValueError, match="NaN or infinity"):
        CODECS[name].encode(x)


@pytest.mark.parametrize("name", list(CODECS))
def test_encode_rejects_unsupported_dtypes_and_shapes(name: str) -> None:
    codec = CODECS[name]
    with pytest.raises(ValueError, match="not supported"):
        codec.encode(torch.ones(2, 2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="n_tokens, kv_heads, head_dim"):
        codec.encode(torch.ones(2, 2))
    with pytest.raises(ValueError, match="not supported"):
        codec.encoded_size(1, 1, 1, torch.int32)
