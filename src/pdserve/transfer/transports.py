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
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass

import zmq

MSG, FRAME = b"M", b"F"


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
