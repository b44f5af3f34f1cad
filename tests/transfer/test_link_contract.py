"""transfer/api.py's contract, run alike over the in-memory fake and every real transport: the
same sends arrive as the same layers and messages, in the order sent, from the sender's
identity; replies come back; a reply to a sender that is gone raises KVLinkError."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import zmq

from factories import eventually
from pdserve.transfer import wire
from pdserve.transfer.api import KVLinkError, KVReceiver, KVSender, LinkSetup, Transport
from pdserve.transfer.fake import FakeNetwork
from pdserve.transfer.transports import TRANSPORTS, get_transport

FP = b"layout-8"
LINKS = ["fake", "tcp", "ipc", "shm", "inproc", "shm-inline"]  # shm-inline: a ring of 0 bytes


class Recorder:
    """A KVSink keeping what arrived, decoded (a frame's buffers die with the call)."""

    def __init__(self) -> None:
        self.got: list[tuple[Any, ...]] = []

    def on_frame(self, peer: bytes, frame: Sequence[wire.Part]) -> None:
        f = wire.decode_frame(frame, fingerprint=FP)
        layers = [(i, k.tolist(), v.tolist()) for i, k, v in f.layers()]
        self.got.append(("frame", peer, f.request_id, f.header.token_start, layers))

    def on_message(self, peer: bytes, message: wire.Part) -> None:
        self.got.append(("message", peer, bytes(message)))


@contextlib.contextmanager
def _link(name: str) -> Iterator[tuple[KVSender, KVReceiver, collections.Counter[str]]]:
    """A sender P0 and a receiver D0 over transport `name`, sharing one zmq context (inproc
    needs it) and one counter (the worker's, in a real worker)."""
    ctx: zmq.Context[Any] = zmq.Context()
    counters: collections.Counter[str] = collections.Counter()
    transport: Transport = FakeNetwork() if name == "fake" else get_transport(name.split("-")[0])
    ring = 0 if name == "shm-inline" else 1 << 20

    def setup(worker_id: str) -> LinkSetup:
        return LinkSetup(worker_id, shm_bytes=ring, counters=counters, zmq_context=ctx)

    receiver = transport.receiver(setup("D0"))
    sender = transport.sender(setup("P0"))
    try:
        yield sender, receiver, counters
    finally:
        sender.close()
        receiver.close()
        ctx.term()


def _kv(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, 2, 4, generator=torch.Generator().manual_seed(seed))


# (request, layer, first token, tokens, codec): two requests interleaved, a quantizing codec too
SENDS = [("r1", 0, 0, 5, "none"), ("r2", 0, 0, 3, "int8"), ("r1", 1, 0, 5, "none"),
         ("r1", 0, 5, 2, "none"), ("r2", 1, 0, 3, "int8")]  # fmt: skip


def _frames() -> list[list[wire.Part]]:
    return [
        wire.encode_frame(rid, layer, start, [_kv(i, n)], [_kv(100 + i, n)], codec, FP)
        for i, (rid, layer, start, n, codec) in enumerate(SENDS)
    ]


def _expected() -> list[tuple[Any, ...]]:
    """What a receiver must hand over: each frame as decoded without any link between."""
    local = Recorder()
    local.on_message(b"P0", b"want r1")
    for frame in _frames():
        local.on_frame(b"P0", [b"".join(bytes(p) for p in frame)])
    local.on_message(b"P0", b"done r1")
    return local.got


@pytest.mark.parametrize("name", LINKS)
def test_the_same_sends_arrive_as_the_same_layers_in_order(name: str) -> None:
    with _link(name) as (sender, receiver, counters):
        sink, dest = Recorder(), receiver.endpoint
        sender.send(dest, b"want r1")
        for (rid, *_), frame in zip(SENDS, _frames(), strict=True):
            sender.send_layer(dest, rid, frame)
        sender.send(dest, b"done r1")

        def arrived() -> bool:
            receiver.poll(sink)
            return len(sink.got) == len(SENDS) + 2

        eventually(arrived, 10, f"everything sent over {name}")
        assert sink.got == _expected()
        assert counters["kv_sends_dropped"] == counters["bad_frames"] == 0
        inline = len(SENDS) if name == "shm-inline" else 0
        assert counters["shm_inline_frames"] == inline


@pytest.mark.parametrize("name", LINKS)
def test_replies_reach_the_sender_and_a_gone_peer_raises(name: str) -> None:
    with _link(name) as (sender, receiver, _):
        sink = Recorder()
        sender.send(receiver.endpoint, b"hello")
        eventually(lambda: receiver.poll(sink) or sink.got, 10, "the first message")
        peer = sink.got[0][1]
        assert peer == b"P0"
        receiver.reply(peer, b"ready")
        receiver.reply(peer, b"ack")
        got: list[bytes] = []
        eventually(lambda: got.extend(sender.poll()) or len(got) == 2, 10, "the replies")
        assert got == [b"ready", b"ack"]
        with pytest.raises(KVLinkError):
            receiver.reply(b"nobody", b"x")


def test_done_frees_the_shm_ring_of_that_request_only() -> None:
    with _link("shm") as (sender, receiver, _):
        sink = Recorder()
        for (rid, *_), frame in zip(SENDS, _frames(), strict=True):
            sender.send_layer(receiver.endpoint, rid, frame)
        eventually(lambda: receiver.poll(sink) or len(sink.got) == len(SENDS), 10, "frames")
        ring = sender.ring  # type: ignore[attr-defined]
        sender.done("r2")  # r1's regions come first: nothing is reclaimed before they go
        assert {r[2] for r in ring.regions} == {"r1", "r2"}
        sender.done("r1")
        assert not ring.regions


def test_every_registered_transport_is_in_the_contract_test() -> None:
    assert set(TRANSPORTS) <= set(LINKS)


@pytest.mark.parametrize("name", ["tcp", "shm"])
def test_a_receivers_poll_returns_within_its_budget_and_leaves_the_rest_queued(name: str) -> None:
    """A D storing frames as fast as P sends them must still get back to its loop (control
    messages: a SetThreads that ends a hold was read 4-7 s late)."""
    from pdserve.transfer import transports

    class Slow(Recorder):
        def on_message(self, peer: bytes, message: wire.Part) -> None:
            time.sleep(0.02)  # a frame's store, made slow
            super().on_message(peer, message)

    with _link(name) as (sender, receiver, _):
        sink, n = Slow(), 20  # 0.4 s of work against a 0.05 s budget
        for i in range(n):
            sender.send(receiver.endpoint, b"m%d" % i)
        eventually(lambda: receiver.poll(sink) or sink.got, 10, "the first message")
        polls, t0 = 1, time.monotonic()
        while len(sink.got) < n:
            start = time.monotonic()
            receiver.poll(sink)
            assert time.monotonic() - start < transports.POLL_BUDGET_S + 0.1
            polls += 1
            assert time.monotonic() - t0 < 10
        assert polls >= 4 and [m[2] for m in sink.got] == [b"m%d" % i for i in range(n)]
