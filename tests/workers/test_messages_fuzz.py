"""Security fuzzing of the control-message decoder: whatever bytes arrive, `decode` returns a
message of a registered type or raises `MessageError` (a ValueError) — never anything else, which
would escape the workers' and the router's `except ValueError` and kill their loops.

Three generators: arbitrary bytes; structure-aware msgpack maps ({"v": 1, "t": <registered type>}
with fields of random, well-typed or wrongly typed values); mutations of valid encodings of every
registered type. Whatever decodes must encode again, to the same bytes. With an HMAC key set
(`set_key`), nothing without the right tag decodes, and the same checks run behind a valid tag.
Deterministic (`derandomize=True`, no example database) and sized to run in a few seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import types
import typing
from collections.abc import Iterator
from typing import Any, Union

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.workers import messages as m

NAMES = sorted(m.REGISTRY)
KEY = b"fuzz-shared-secret"
HINTS = {name: typing.get_type_hints(cls) for name, cls in m.REGISTRY.items()}

BASE = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def fuzz(n: int) -> settings:
    return settings(BASE, max_examples=n)


# Every int msgpack can carry, with the edges drawn often; floats with nan and infinities.
INTS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, -1, 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]),
)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
SCALARS = st.one_of(
    st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=12), st.binary(max_size=12)
)
ANY_VALUE = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), INTS), children, max_size=4),
    ),
    max_leaves=12,
)
# Values for "t" other than a registered name. Only hashable ones: see
# test_unhashable_type_tag_is_a_message_error for lists and maps.
OTHER_TAGS = st.one_of(
    st.text(max_size=12), INTS, st.none(), st.booleans(), st.binary(max_size=8),
    st.floats(allow_nan=False), st.sampled_from([n.lower() for n in NAMES] + ["Message"]),
)  # fmt: skip


def value_for(hint: Any) -> st.SearchStrategy[Any]:
    """A value the decoder must accept for a field annotated `hint`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return ANY_VALUE
    if origin in (Union, types.UnionType):
        return st.one_of(*(value_for(a) for a in args))
    if hint is type(None):
        return st.none()
    if hint is bool:
        return st.booleans()
    if hint is int:
        return INTS
    if hint is float:
        return st.one_of(FLOATS, INTS)  # an int is a valid float on the wire
    if hint is str:
        return st.text(max_size=16)
    if hint is bytes:
        return st.binary(max_size=16)
    if origin is list:
        return st.lists(value_for(args[0]), max_size=5)
    if origin is dict:
        return st.dictionaries(value_for(args[0]), value_for(args[1]), max_size=4)
    raise AssertionError(f"no strategy for {hint!r}")


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


@st.composite
def well_typed_fields(draw: st.DrawFn, name: str) -> dict[str, Any]:
    """Every required field and some optional ones, each of its declared type."""
    out = {}
    for f in dataclasses.fields(m.REGISTRY[name]):
        if _required(f) or draw(st.booleans()):
            out[f.name] = draw(value_for(HINTS[name][f.name]))
    return out


@st.composite
def messages(draw: st.DrawFn) -> Any:
    """A valid message of any registered type."""
    name = draw(st.sampled_from(NAMES))
    return m.REGISTRY[name](**draw(well_typed_fields(name)))


@st.composite
def fuzzed_bodies(draw: st.DrawFn) -> dict[Any, Any]:
    """A version-1 map of a registered type; each field well typed, random, or missing; maybe
    extra keys; now and then a wrong "v" or "t"."""
    name = draw(st.sampled_from(NAMES))
    body: dict[Any, Any] = {"v": 1, "t": name}
    for f in dataclasses.fields(m.REGISTRY[name]):
        how = draw(st.sampled_from(["typed", "typed", "random", "omit"]))
        if how == "typed":
            body[f.name] = draw(value_for(HINTS[name][f.name]))
        elif how == "random":
            body[f.name] = draw(ANY_VALUE)
    if draw(st.integers(0, 5)) == 0:
        extra = st.one_of(st.text(max_size=8), INTS, st.sampled_from(["rid", "seq", "params"]))
        body.update(draw(st.dictionaries(extra, ANY_VALUE, min_size=1, max_size=2)))
    if draw(st.integers(0, 7)) == 0:
        body["v"] = draw(st.one_of(st.just(1.0), st.just(True), INTS, st.text(max_size=3)))
    if draw(st.integers(0, 7)) == 0:
        body["t"] = draw(OTHER_TAGS)
    if draw(st.integers(0, 15)) == 0:
        del body[draw(st.sampled_from(["v", "t"]))]
    return body


def pack(obj: Any, key: bytes | None = None) -> bytes:
    """msgpack of obj; with a key, followed by its HMAC-SHA256 tag (the authenticated form)."""
    body = msgpack.packb(obj, use_bin_type=True)
    return body if key is None else body + hmac.new(key, body, hashlib.sha256).digest()


@pytest.fixture(autouse=True, scope="module")
def _no_key() -> Iterator[None]:
    m.set_key(None)  # the unauthenticated form, unless a test says otherwise
    yield
    m.set_key(None)


@contextlib.contextmanager
def keyed(key: bytes | None) -> Iterator[None]:
    m.set_key(key)
    try:
        yield
    finally:
        m.set_key(None)


def decode_or_none(data: bytes | memoryview) -> Any:
    """decode(data), or None for a MessageError; any other exception fails the test."""
    try:
        out = m.decode(data)
    except m.MessageError as e:
        assert isinstance(e, ValueError)
        return None
    assert m.REGISTRY.get(type(out).__name__) is type(out), out
    assert m.encode(m.decode(m.encode(out))) == m.encode(out)  # bytes: nan != nan
    return out


# ---- (a) arbitrary bytes -------------------------------------------------------------------------
@fuzz(500)
@given(st.binary(max_size=300))
def test_arbitrary_bytes(data: bytes) -> None:
    decode_or_none(data)
    decode_or_none(memoryview(data))
    with keyed(KEY):
        assert decode_or_none(data) is None  # no tag can be guessed


@fuzz(400)
@given(st.sampled_from([b"\x82\xa1v\x01\xa1t", b"\x83\xa1v\x01\xa1t", b"\xde\x00\x03"]), st.data())
def test_arbitrary_bytes_after_a_plausible_prefix(prefix: bytes, data: st.DataObject) -> None:
    """Past the "v": 1 key, so random tails reach the type lookup and the field checks."""
    decode_or_none(prefix + data.draw(st.binary(max_size=200)))


# ---- (b) structure-aware -------------------------------------------------------------------------
@fuzz(250)
@given(fuzzed_bodies(), st.sampled_from([None, KEY]))
def test_structured_bodies(body: dict[Any, Any], key: bytes | None) -> None:
    """Also behind a valid HMAC tag: authenticated peers get the same checks."""
    with keyed(key):
        out = decode_or_none(pack(body, key))
    if out is not None:
        assert type(out).__name__ == body["t"]
        got = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
        assert pack({k: v for k, v in got.items() if k in body}) == pack(
            {k: body[k] for k in got if k in body}
        )


@fuzz(300)
@given(messages())
def test_every_well_typed_message_decodes_and_round_trips(msg: Any) -> None:
    """No false rejections: any value of each field's declared type is accepted."""
    raw = m.encode(msg)
    out = m.decode(raw)
    assert type(out) is type(msg)
    assert m.encode(out) == raw


@fuzz(150)
@given(st.sampled_from(NAMES), st.data())
def test_every_type_rejects_each_missing_required_field(name: str, data: st.DataObject) -> None:
    fields = data.draw(well_typed_fields(name))
    required = [f.name for f in dataclasses.fields(m.REGISTRY[name]) if _required(f)]
    if not required:
        assert decode_or_none(pack({"v": 1, "t": name, **fields})) is not None
        return
    drop = data.draw(st.sampled_from(required))
    body = {"v": 1, "t": name, **{k: v for k, v in fields.items() if k != drop}}
    with pytest.raises(m.MessageError, match="missing"):
        m.decode(pack(body))


# ---- (c) mutations of valid encodings ------------------------------------------------------------
@st.composite
def mutated(draw: st.DrawFn, raw: bytes) -> bytes:
    buf = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "append"]))
        if kind == "append":
            buf += draw(st.binary(min_size=1, max_size=16))
        elif not buf:
            continue
        elif kind == "flip":
            bit = draw(st.integers(0, 8 * len(buf) - 1))
            buf[bit // 8] ^= 1 << (bit % 8)
        elif kind == "set":
            buf[draw(st.integers(0, len(buf) - 1))] = draw(st.integers(0, 255))
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
@given(st.sampled_from(NAMES), st.sampled_from([None, KEY]), st.data())
def test_mutations_of_every_type(name: str, key: bytes | None, data: st.DataObject) -> None:
    with keyed(key):
        raw = m.encode(m.REGISTRY[name](**data.draw(well_typed_fields(name))))
        bad = data.draw(mutated(raw))
        out = decode_or_none(bad)
    if key is not None:
        assert out is None or bad == raw  # the tag covers every byte


@pytest.mark.parametrize("name", NAMES)
def test_tags_are_required_and_checked(name: str) -> None:
    body = {"v": 1, "t": name, **_small_fields(name)}
    with keyed(KEY):
        assert decode_or_none(pack(body, KEY)) is not None
        assert decode_or_none(pack(body)) is None  # untagged
        assert decode_or_none(pack(body, b"another key")) is None
    assert decode_or_none(pack(body)) is not None
    assert decode_or_none(pack(body, KEY)) is None  # without a key, a tag is trailing bytes


def _small_fields(name: str) -> dict[str, Any]:
    """Small values for the required fields of a type."""
    hints = HINTS[name]
    return {
        f.name: _small(hints[f.name]) for f in dataclasses.fields(m.REGISTRY[name]) if _required(f)
    }


def _small(hint: Any) -> Any:
    """A small value of a field's type (lists and maps of one item, nested as declared)."""
    scalar = {str: "ab", int: 7, float: 0.5, bytes: b"\x01\x02"}.get(hint)
    if scalar is not None:
        return scalar
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return [_small(args[0])]
    if origin is dict:
        return {_small(args[0]): _small(args[1])}
    return 3  # Any


@pytest.mark.parametrize("name", NAMES)
def test_every_truncation_and_single_bit_flip(name: str) -> None:
    """Exhaustive on one small message per type (not random: every position)."""
    fields = _small_fields(name)
    raw = m.encode(m.REGISTRY[name](**fields))
    assert m.decode(raw) == m.REGISTRY[name](**fields)
    for end in range(len(raw)):
        assert decode_or_none(raw[:end]) is None  # msgpack needs every byte of the map
    for bit in range(8 * len(raw)):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        decode_or_none(bytes(flipped))
    assert decode_or_none(raw + b"\x00") is None  # trailing bytes are not ignored


# ---- size bound ----------------------------------------------------------------------------------
def _hello_of_size(n: int) -> bytes:
    """A valid Hello encoding of exactly n bytes (n >= 64 KiB: str32 header)."""
    overhead = len(m.encode(m.Hello("x" * 70_000))) - 70_000
    raw = m.encode(m.Hello("x" * (n - overhead)))
    assert len(raw) == n
    return raw


@fuzz(8)
@given(st.integers(-2, 3))
def test_nothing_over_max_message_bytes_is_accepted(delta: int) -> None:
    raw = _hello_of_size(m.MAX_MESSAGE_BYTES + delta)
    for data in (raw, memoryview(raw)):
        if delta <= 0:
            assert isinstance(m.decode(data), m.Hello)
        else:
            with pytest.raises(m.MessageError, match="exceeds"):
                m.decode(data)


@fuzz(10)
@given(messages(), st.integers(1, 64))
def test_a_valid_message_padded_past_the_limit_is_rejected(msg: Any, pad: int) -> None:
    raw = m.encode(msg)
    padded = raw + b"\xc0" * (m.MAX_MESSAGE_BYTES - len(raw) + pad)  # msgpack nils
    with pytest.raises(m.MessageError, match="exceeds"):
        m.decode(padded)


def test_lying_container_lengths_do_not_allocate() -> None:
    """Headers claiming 2**32 - 1 elements in a few bytes: an error, at once."""
    for raw in (
        b"\xdd\xff\xff\xff\xff",  # array32
        b"\xdf\xff\xff\xff\xff",  # map32
        b"\xdb\xff\xff\xff\xff",  # str32
        b"\xc6\xff\xff\xff\xff",  # bin32
        b"\x83\xa1v\x01\xa1t\xa5Hello\xa6client\xdb\xff\xff\xff\xff",
    ):
        assert decode_or_none(raw) is None


def test_deep_nesting_decodes_and_re_encodes_or_is_rejected() -> None:
    """msgpack's parser stops at its stack limit; whatever it accepts, encode takes back."""
    for depth in (10, 500, 1000, 1100, 100_000):
        # Stats{"stats": {"a": [[[...0...]]]}}, `depth` arrays deep
        raw = b"\x83\xa1v\x01\xa1t\xa5Stats\xa5stats\x81\xa1a" + b"\x91" * depth + b"\x00"
        out = decode_or_none(raw)
        assert (out is not None) == (depth <= 1000), depth


# ---- found by fuzzing ---------------------------------------------------------------------------
@pytest.mark.parametrize("tag", [[], {}, ["Hello"], {"a": 1}])
def test_unhashable_type_tag_is_a_message_error(tag: Any) -> None:
    # was a TypeError (an unhashable tag looked up in REGISTRY), which killed a worker's loop
    assert decode_or_none(pack({"v": 1, "t": tag, "client": "c"})) is None
