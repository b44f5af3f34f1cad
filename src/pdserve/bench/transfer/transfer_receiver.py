"""The receiving end of a `pdserve bench transfer` link: a separate process (spawned) that
serves one link at a time, as the sender asks through a pipe: the real transport (a ROUTER
from `bind_receiver`, frames into a `transfer_kv.Store`, as a decode worker does) or the raw
socket baseline (recv_into a preallocated buffer, one byte of reply)."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pdserve.bench.transfer.transfer_kv import Store
from pdserve.bench.transfer.transfer_results import OP_SETUP, OP_STOP, SOCK_HEAD

if TYPE_CHECKING:
    import zmq


def serve_zmq(conn: Connection, transport: str, ctx: zmq.Context | None = None) -> None:
    """Receiver of the real transport: ROUTER from `bind_receiver`, frames as `Worker` does."""
    import msgpack
    import zmq

    from pdserve.transfer import wire
    from pdserve.transfer.shm import ShmReader
    from pdserve.transfer.transports import FRAME, MSG, SHM_FRAME, ZMQ_TRANSPORTS, bind_receiver

    own = ctx is None
    context = zmq.Context() if ctx is None else ctx
    sock, endpoint = bind_receiver(context, ZMQ_TRANSPORTS[transport], "127.0.0.1", 0, "bench-D")
    conn.send(endpoint)
    store, reader = Store(), ShmReader()
    try:
        while True:
            parts = sock.recv_multipart(copy=False)
            peer, kind = parts[0].bytes, parts[1].bytes
            if kind == FRAME:
                store.on_frame([p.buffer for p in parts[2:]])
            elif kind == SHM_FRAME:
                payload = reader.view(parts[3].bytes, wire.DEFAULT_MAX_PAYLOAD)
                try:
                    store.on_frame([parts[2].buffer, payload])
                finally:
                    payload.release()
            elif kind == MSG:
                msg = msgpack.unpackb(parts[2].bytes)
                reply: dict[str, Any] = {"op": "bye"}
                if msg["op"] == "setup":
                    store.setup(msg)
                    reply = {"op": "ready"}
                elif msg["op"] == "done":
                    reply = {"op": "ack", **store.report(), "done_at": time.monotonic()}
                    store.reset()
                sock.send_multipart([peer, MSG, msgpack.packb(reply)])
                if msg["op"] == "stop":
                    break
    finally:
        reader.close()
        sock.close(0)
        if own:
            context.term()


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the baseline socket")
        got += n


def _serve_socket(conn: Connection, family: str) -> None:
    """Receiver of the raw socket baseline: recv_into a preallocated bytearray, reply 1 byte."""
    if family == "tcp":
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind(("127.0.0.1", 0))
        address: Any = srv.getsockname()
    else:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = os.path.join(tempfile.gettempdir(), f"pdserve-bench-{os.getpid()}.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)
        srv.bind(address)
    srv.listen(1)
    conn.send(address)
    peer, _ = srv.accept()
    if family == "tcp":
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf, head = bytearray(0), bytearray(SOCK_HEAD.size)
    try:
        while True:
            recv_exact(peer, memoryview(head))
            op, n = SOCK_HEAD.unpack(head)
            if op == OP_STOP:
                break
            if op == OP_SETUP:
                buf = bytearray(n)
            else:
                recv_exact(peer, memoryview(buf)[:n])
            peer.sendall(b"k")
    finally:
        peer.close()
        srv.close()
        if family != "tcp":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)


def _receiver_main(conn: Connection) -> None:
    """The receiver process: serves one link at a time, as the sender asks through `conn`."""
    from multiprocessing import resource_tracker

    import torch

    torch.set_num_threads(1)
    # A worker is its own process with its own resource tracker; a spawned child shares its
    # parent's, and ShmReader's unregister of the ring would then drop the sender's own
    # registration (a KeyError traceback from the tracker when the ring is unlinked).
    own = resource_tracker.ResourceTracker()
    resource_tracker._resource_tracker = own
    resource_tracker.register, resource_tracker.unregister = own.register, own.unregister
    resource_tracker.ensure_running = own.ensure_running
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        kind, name = cmd
        if kind == "zmq":
            serve_zmq(conn, name)
        else:
            _serve_socket(conn, name)


class ReceiverProcess:
    def __init__(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def serve(self, kind: str, name: str) -> Any:
        """Ask the receiver to serve a link; returns its address once it is bound."""
        self.conn.send((kind, name))
        if not self.conn.poll(120):
            raise RuntimeError("the receiver process did not bind its socket")
        return self.conn.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()
