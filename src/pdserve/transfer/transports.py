"""KV transports, chosen from a registry by name (`--transport`): transfer/api.py's `KVSender`
and `KVReceiver` over ZeroMQ.

Each link is a pair of ZeroMQ sockets: the receiving worker (D) binds a ROUTER, every sender (P)
connects a DEALER whose identity is its worker id. One connection carries both the KV frames
(P -> D) and the small hand-off messages both ways, so a failure on the link is seen by both
ends. ZeroMQ keeps order per connection, which is the order api.py promises.

Multipart layout: [b"M", message] or [b"F", frame header, frame payload parts...] or
[b"S", frame header, shared-memory reference].

  * `tcp`    — any host; frames are sent zero-copy from the sender's buffers.
  * `inproc` — workers that are threads of one process (tests): no kernel, no copy.
  * `ipc`    — same host over a Unix socket.
  * `shm`    — same host: the payload is written once into a shared-memory ring owned by the
               sender and read once by the receiver straight into its KV blocks (transfer/shm.py);
               only the frame header and the ring position travel over the (ipc) socket.

Adding a transport (RDMA, a GPU copy engine): a class with api.py's `Transport` methods, whose
`sender` and `receiver` keep api.py's contract, in its own module under transfer/ (its heavy
imports inside those methods), and one entry in `TRANSPORTS`; then add its name to the contract
test (tests/transfer/test_link_contract.py). `shm` is the model of a transport whose payload
goes around the socket: the header travels in order with the messages, the bytes out of band.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from pdserve.transfer import wire
from pdserve.transfer.api import KVLinkError, KVSender, KVSink, LinkSetup, Transport
from pdserve.transfer.shm import ShmReader, ShmRing
from pdserve.transfer.wire import Part

MSG, FRAME, SHM_FRAME = b"M", b"F", b"S"
POLL_BUDGET_S = 0.05  # a receiver's poll returns after this, what is left still queued

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ZmqTransport:
    name: str
    socket: str  # what the receiver binds: tcp | ipc | inproc
    shm: bool = False  # payloads through a shared-memory ring (ShmRing)

    def bind_endpoint(self, host: str, port: int, worker_id: str) -> str:
        if self.socket == "tcp":
            return f"tcp://{host}:{port or '*'}"
        if self.socket == "inproc":
            return f"inproc://kv-{worker_id}-{uuid.uuid4().hex[:8]}"
        path = os.path.join(tempfile.gettempdir(), f"pdserve-kv-{worker_id}-{os.getpid()}")
        return f"ipc://{path}"

    def receiver(self, setup: LinkSetup) -> ZmqReceiver:
        return ZmqReceiver(self, setup)

    def sender(self, setup: LinkSetup) -> KVSender:
        return ZmqSender(self, setup)


ZMQ_TRANSPORTS: dict[str, ZmqTransport] = {
    "tcp": ZmqTransport("tcp", "tcp"),
    "inproc": ZmqTransport("inproc", "inproc"),
    "ipc": ZmqTransport("ipc", "ipc"),
    "shm": ZmqTransport("shm", "ipc", shm=True),  # the socket is ipc; payloads go through ShmRing
}
TRANSPORTS: dict[str, Transport] = {**ZMQ_TRANSPORTS}


def get_transport(name: str) -> Transport:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(
            f"unknown transport {name!r}; choose one of {', '.join(sorted(TRANSPORTS))}"
        ) from None


def bind_receiver(
    ctx: zmq.Context, transport: ZmqTransport, host: str, port: int, worker_id: str
) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises instead of vanishing
    sock.bind(transport.bind_endpoint(host, port, worker_id))
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect_sender(ctx: zmq.Context, endpoint: str, worker_id: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, worker_id.encode())
    sock.connect(endpoint)
    return sock


class ZmqReceiver:
    """D's end: a ROUTER; `shm` payloads are read in place from the senders' rings."""

    def __init__(self, transport: ZmqTransport, setup: LinkSetup) -> None:
        ctx = setup.zmq_context or zmq.Context.instance()
        self.sock, self._endpoint = bind_receiver(
            ctx, transport, setup.host, setup.port, setup.worker_id
        )
        self.counters = setup.counters
        self.shm = ShmReader()
        if setup.poller is not None:
            setup.poller.register(self.sock, zmq.POLLIN)

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def poll(self, sink: KVSink) -> None:
        # At most POLL_BUDGET_S a call (what is left wakes the loop's poller at once): P streams
        # frames as it computes, and a D storing them as fast as they came stayed here 4.1 s
        # with its control messages unread (measured under `--adaptive`: a SetThreads that ends
        # a hold was acknowledged 4-7 s late, and a concurrent hand-off's reservation failed)
        deadline = time.monotonic() + POLL_BUDGET_S
        while time.monotonic() < deadline:
            try:
                peer, *parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._deliver(peer.bytes, parts, sink)

    def _deliver(self, peer: bytes, parts: list[Any], sink: KVSink) -> None:
        kind = parts[0].bytes if parts else b""
        if kind == FRAME:
            sink.on_frame(peer, [p.buffer for p in parts[1:]])
        elif kind == SHM_FRAME:
            self._shm_frame(peer, [p.buffer for p in parts[1:]], sink)
        elif kind == MSG and len(parts) == 2:
            sink.on_message(peer, parts[1].buffer)
        else:
            self.counters["bad_frames"] += 1

    def _shm_frame(self, peer: bytes, parts: list[memoryview], sink: KVSink) -> None:
        """A frame whose payload sits in the sender's shared-memory ring: [header, ref]."""
        try:
            if len(parts) != 2:
                raise ValueError("expected [header, ring reference]")
            payload = self.shm.view(bytes(parts[1]), wire.DEFAULT_MAX_PAYLOAD)
        except (ValueError, OSError) as e:
            self.counters["bad_frames"] += 1
            log.warning("dropping a bad shared-memory frame from %r: %s", peer, e)
            return
        try:
            sink.on_frame(peer, [parts[0], payload])
        finally:
            payload.release()  # the segment stays mapped; a view left behind would pin it

    def reply(self, peer: bytes, message: bytes) -> None:
        try:
            self.sock.send_multipart([peer, MSG, message])
        except zmq.ZMQError as e:  # EHOSTUNREACH: ROUTER_MANDATORY and the peer is gone
            raise KVLinkError(f"cannot reach {peer!r}: {e}") from e

    def close(self) -> None:
        self.shm.close()
        self.sock.close(0)


class ZmqSender:
    """P's end: a DEALER per D endpoint, connected on first use; `shm` writes payloads to a
    ring (ShmRing) and sends their position, or the payload inline when the ring is full."""

    def __init__(self, transport: ZmqTransport, setup: LinkSetup) -> None:
        self.ctx = setup.zmq_context or zmq.Context.instance()
        self.worker_id, self.poller, self.counters = setup.worker_id, setup.poller, setup.counters
        self.socks: dict[str, zmq.Socket] = {}  # endpoint -> DEALER
        self.ring = ShmRing(setup.shm_bytes) if transport.shm else None

    def send_layer(self, dest: str, rid: str, frame: Sequence[Part]) -> None:
        self._send(dest, self._pack(rid, frame))

    def _pack(self, rid: str, frame: Sequence[Part]) -> list[Part]:
        """Multipart for the link: payload inline, or written to the shared-memory ring."""
        if self.ring is not None:
            ref = self.ring.put(rid, frame[1:])
            if ref is not None:
                return [SHM_FRAME, frame[0], ref]
            self.counters["shm_inline_frames"] += 1
        return [FRAME, *frame]

    def send(self, dest: str, message: bytes) -> None:
        self._send(dest, [MSG, message])

    def _send(self, dest: str, parts: list[Part]) -> None:
        try:
            # never block the main loop on a dead or wedged D: its queue (SNDHWM messages)
            # fills and the frame is dropped; D's completeness check then fails the hand-off,
            # and the router retries or recovers the request
            self._sock(dest).send_multipart(parts, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.counters["kv_sends_dropped"] += 1

    def _sock(self, dest: str) -> zmq.Socket:
        sock = self.socks.get(dest)
        if sock is None:
            sock = connect_sender(self.ctx, dest, self.worker_id)
            if self.poller is not None:
                self.poller.register(sock, zmq.POLLIN)
            self.socks[dest] = sock
        return sock

    def done(self, rid: str) -> None:
        if self.ring is not None:
            self.ring.release(rid)

    def poll(self) -> list[bytes]:
        out = []
        for sock in self.socks.values():
            while True:
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if len(parts) != 2 or parts[0].bytes != MSG:
                    self.counters["bad_frames"] += 1
                    continue
                out.append(parts[1].bytes)
        return out

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close(0)
        if self.ring is not None:
            self.ring.close()
