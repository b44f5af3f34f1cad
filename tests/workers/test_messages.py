"""Control messages: every type round-trips; the decoder gives MessageError on anything else."""

from __future__ import annotations

import contextlib
import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.request import SamplingParams
from pdserve.workers import messages as m

SAMPLES = [
    m.Hello("c"),
    m.Generate("r", [1, 2], {"max_tokens": 3, "temperature": 0.0}),
    m.Prefill("r", [1], {}, "D0", "tcp://127.0.0.1:5", 2),
    m.ExpectKV("r", [1], {}, "P0"),
    m.Abort("r"),
    m.GetStats(),
    m.GetSteps(12.5),
    m.SetFault("drop", 2, 0.5),
    m.SetFault("slow", -1, 0.2),
    m.Shutdown(),
    m.SetRole("decode"),
    m.SetThreads(3),
    m.SetThreads(2, 256),
    m.Ping(7),
    m.Pong(7, "D0", 0.25),
    m.WorkerInfo("P0", "prefill", 1, "tcp://x", 16, 100, b"\x00" * 8, "m"),
    m.WorkerInfo("P0", "prefill", 1, "tcp://x", 16, 100, b"\x00" * 8, "m", "tcp://hb"),
    m.Tokens("r", "D0", [5, 6], "hi", True, "stop", "\n", [{5: -0.5}, {6: -1.0}]),
    m.TransferReport("r", "P0", "send", 3, 1000, 0.5, "int8"),
    m.RequestFailed("r", "D0", "why", "transfer"),
    m.Stats({"a": 1, "b": [1, 2]}),
    m.Steps("D0", [[1.0, 0.04, 2, 300], [1.1, 0.2, 0, 0, 256, 0]]),
    m.Steps("P0", [[1.0, 0.3, 0, 0, 64, 0]], [2]),
    m.KVEvents("D-1", 3, 16, [b"\x01" * 32], [b"\x02" * 32], cleared=True),
    m.KVWant("r", "P0"),
    m.KVReady("r"),
    m.KVDone("r", [5], 10, 30),
    m.KVAck("r"),
    m.KVFail("r", "checksum"),
]


def test_every_registered_type_has_a_sample() -> None:
    assert {type(s).__name__ for s in SAMPLES} == set(m.REGISTRY)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip(msg) -> None:  # type: ignore[no-untyped-def]
    assert m.decode(m.encode(msg)) == msg


@pytest.mark.parametrize(
    "body",
    [
        {"v": 2, "t": "Abort", "rid": "r"},  # unknown version
        {"v": 1, "t": "Pickle", "rid": "r"},  # unknown type
        {"v": 1, "t": "Abort"},  # missing field
        {"v": 1, "t": "Abort", "rid": "r", "extra": 1},  # unknown field
        {"v": 1, "t": "Abort", "rid": 5},  # wrong type
        {"v": 1, "t": "Generate", "rid": "r", "prompt_ids": [1, "x"], "params": {}},
        {"v": 1, "t": "KVDone", "rid": "r", "output_ids": [], "num_kv_tokens": True, "frames": 1},
        [1, 2, 3],  # not a map
    ],
)
def test_malformed_bodies_are_rejected(body) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(m.MessageError):
        m.decode(msgpack.packb(body))


def test_oversized_message_is_rejected_before_parsing() -> None:
    with pytest.raises(m.MessageError, match="exceeds"):
        m.decode(b"\x00" * (m.MAX_MESSAGE_BYTES + 1))


def test_only_registered_dataclasses_encode() -> None:
    @dataclasses.dataclass
    class Hello:  # same name, different class
        client: str

    with pytest.raises(m.MessageError):
        m.encode(Hello("x"))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_give_message_error_only(data: bytes) -> None:
    with contextlib.suppress(m.MessageError):
        m.decode(data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_messages_give_message_error_or_a_valid_message(msg, data) -> None:  # type: ignore[no-untyped-def]
    raw = bytearray(m.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        out = m.decode(bytes(raw[:cut]))
    except m.MessageError:
        return
    assert type(out).__name__ in m.REGISTRY  # a mutation may still spell a valid message


def test_sampling_params_from_the_wire_are_validated() -> None:
    assert m.sampling_params({"max_tokens": 3}).max_tokens == 3
    with pytest.raises(m.MessageError, match="unknown"):
        m.sampling_params({"max_tokens": 3, "evil": 1})
    with pytest.raises(ValueError, match="top_p"):
        m.sampling_params({"top_p": 2.0})


def test_sampling_params_extras_travel_only_when_set() -> None:
    plain = SamplingParams(max_tokens=3)
    assert "logit_bias" not in plain.to_wire() and "presence_penalty" not in plain.to_wire()
    sp = SamplingParams(
        max_tokens=3, presence_penalty=0.5, repetition_penalty=1.2, logit_bias={"7": -100.0}
    )
    msg = m.decode(m.encode(m.Generate("r", [1, 2], sp.to_wire())))
    assert m.sampling_params(msg.params) == sp
    with pytest.raises(m.MessageError):
        m.sampling_params({"max_tokens": 3, "presence_penalty": "high"})
    with pytest.raises(ValueError, match="logit_bias"):
        m.sampling_params({"max_tokens": 3, "logit_bias": [1, 2]})


def test_a_set_threads_without_a_step_cap_keeps_the_engines_budget() -> None:
    """A router that sends no `step_tokens` (the field came later) still decodes: 0."""
    body = msgpack.packb({"v": m.VERSION, "t": "SetThreads", "threads": 2})
    assert m.decode(body) == m.SetThreads(2, 0)
