"""KV transports, chosen from a registry by name.

Each transport is a pair of ZeroMQ sockets: the receiving worker (D) binds a ROUTER, every
sender (P) connects a DEALER whose identity is its worker id. One connection carries both the
KV frames (P -> D) and the small hand-off messages both ways (KVWant/KVReady/KVDone/KVAck/KVFail),
so a failure on the link is seen by both ends. ZeroMQ keeps order per connection, which lets D
require each layer's token ranges to arrive in order.

Multipart layout: [b"M", msgpack message] or [b"F", frame header, frame payload parts...].

  * `tcp`    — any host; frames are sent zero-copy from the sender's buffers.
  * `inproc` — workers that are threads of one process (tests): no kernel, no copy.
  * `ipc`    — same host over a Unix socket.
  * `shm`    — same host: the payload is written once into a shared-memory ring owned by the
               sender and read once by the receiver straight into its KV blocks; only the frame
               header and the ring position travel over the (ipc) socket. A request's ring space
               is released when its hand-off ends (ack, failure, abort). When the ring is full a
               frame goes inline over the socket instead — counted (`shm_inline_frames`), never
               silent.
"""

from __future__ import annotations

import collections
import os
import struct
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import zmq

MSG, FRAME, SHM_FRAME = b"M", b"F", b"S"
_SHM_REF = struct.Struct("<QQ")  # offset, length; followed by the segment name


@dataclass(frozen=True)
class Transport:
    name: str

    def bind_endpoint(self, host: str, port: int, worker_id: str) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class TcpTransport(Transport):
    def bind_endpoint(self, host: str, port: int, worker_id: str) -> str:
        return f"tcp://{host}:{port or '*'}"


@dataclass(frozen=True)
class InprocTransport(Transport):
    def bind_endpoint(self, host: str, port: int, worker_id: str) -> str:
        return f"inproc://kv-{worker_id}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class IpcTransport(Transport):
    def bind_endpoint(self, host: str, port: int, worker_id: str) -> str:
        path = os.path.join(tempfile.gettempdir(), f"pdserve-kv-{worker_id}-{os.getpid()}")
        return f"ipc://{path}"


TRANSPORTS: dict[str, Transport] = {
    "tcp": TcpTransport("tcp"),
    "inproc": InprocTransport("inproc"),
    "ipc": IpcTransport("ipc"),
    "shm": IpcTransport("shm"),  # the socket is ipc; payloads go through ShmRing
}


def get_transport(name: str) -> Transport:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(
            f"unknown transport {name!r}; choose one of {', '.join(sorted(TRANSPORTS))}"
        ) from None


def bind_receiver(
    ctx: zmq.Context, transport: Transport, host: str, port: int, worker_id: str
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


class ShmRing:
    """Sender side of `shm`: a ring of shared memory, space released per request."""

    def __init__(self, size: int) -> None:
        # size 0: no segment at all, every frame goes inline (tests of the fallback use it).
        self.shm = shared_memory.SharedMemory(create=True, size=size) if size > 0 else None
        self.size = size
        self.head = 0  # next write position
        self.regions: collections.deque[tuple[int, int, str]] = collections.deque()
        self.released: set[str] = set()

    def put(self, rid: str, parts: Sequence[bytes | memoryview]) -> bytes | None:
        """Copy `parts` into the ring; returns the reference to send, or None when full."""
        n = sum(memoryview(p).nbytes for p in parts)
        start = self._allocate(n)
        if start is None:
            return None
        pos = start
        assert self.shm is not None and self.shm.buf is not None
        buf = self.shm.buf
        for p in parts:
            view = memoryview(p).cast("B")
            buf[pos : pos + view.nbytes] = view
            pos += view.nbytes
        self.regions.append((start, start + n, rid))
        return _SHM_REF.pack(start, n) + self.shm.name.encode()

    def _allocate(self, n: int) -> int | None:
        if n == 0 or n > self.size:
            return None
        if not self.regions:
            self.head = 0
            return self._claim(0, n)
        tail = self.regions[0][0]
        if self.head > tail:  # not wrapped: free space is [head, size) and [0, tail)
            if self.size - self.head >= n:
                return self._claim(self.head, n)
            return self._claim(0, n) if tail >= n else None
        return self._claim(self.head, n) if tail - self.head >= n else None

    def _claim(self, start: int, n: int) -> int:
        self.head = start + n
        return start

    def release(self, rid: str) -> None:
        self.released.add(rid)
        while self.regions and self.regions[0][2] in self.released:
            self.regions.popleft()
        live = {r[2] for r in self.regions}
        self.released &= live

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()


class ShmReader:
    """Receiver side of `shm`: maps senders' rings by name and hands out views of payloads."""

    def __init__(self) -> None:
        self.segments: dict[str, shared_memory.SharedMemory] = {}

    def view(self, ref: bytes, max_len: int) -> memoryview:
        if len(ref) <= _SHM_REF.size or len(ref) > _SHM_REF.size + 255:
            raise ValueError("malformed shared-memory reference")
        start, n = _SHM_REF.unpack_from(ref)
        name = ref[_SHM_REF.size :].decode("ascii", errors="strict")
        seg = self._segment(name)
        if n > max_len or start + n > seg.size:
            raise ValueError(f"shared-memory range {start}+{n} outside the segment or too large")
        assert seg.buf is not None
        return seg.buf[start : start + n]

    def _segment(self, name: str) -> shared_memory.SharedMemory:
        seg = self.segments.get(name)
        if seg is None:
            seg = shared_memory.SharedMemory(name=name)
            # The sender owns and unlinks it; stop this process's tracker from doing so too.
            resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
            self.segments[name] = seg
        return seg

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()
