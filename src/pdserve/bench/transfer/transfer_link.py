"""The two ends of a KV link for `pdserve bench transfer`: a receiver process doing what a
decode worker does per frame, and the sender side (split from `transfer_bench`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pdserve.bench.transfer.transfer_report import (
    _OP_SETUP,
    _OP_STOP,
    _SOCK_HEAD,
    ACK_TIMEOUT_S,
    BLOCK_SIZE,
    SEED,
    SHM_MB,
    Layout,
    ThroughputRow,
)

if TYPE_CHECKING:
    import torch
    import zmq


# --------------------------------------------------------------------------- helpers


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _minor_faults() -> int:
    """Minor page faults of this thread so far: first touches of freshly allocated memory."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def _torch_dtype(dtype: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _shuffled_slots(n: int, seed: int = SEED) -> torch.Tensor:
    """Slots of tokens [0, n) in a paged cache whose block table is a random permutation."""
    import torch

    blocks = -(-n // BLOCK_SIZE)
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(n)
    return table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def _random_kv(layout: Layout, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    shape = (layout.layers, n, layout.kv_heads, layout.head_dim)
    dtype = _torch_dtype(layout.dtype)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def _fingerprint(layout: Layout) -> bytes:
    from pdserve.kv_layout import KVLayout

    dtype = _torch_dtype(layout.dtype)
    return KVLayout(layout.layers, layout.kv_heads, layout.head_dim, dtype).fingerprint()


def _encode_layers(
    rid: str, keys: torch.Tensor, values: torch.Tensor, codec: str, fp: bytes
) -> list[list[Any]]:
    from pdserve.transfer import wire

    return [
        wire.encode_frame(rid, layer, 0, [keys[layer]], [values[layer]], codec, fp)
        for layer in range(keys.shape[0])
    ]


# --------------------------------------------------------------------------- receiver side


class _Store:
    """What `DecodeSide` does with frames: check, decode, copy into a paged cache."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self.fingerprint: bytes | None = None
        self.reset()

    def reset(self) -> None:
        self.frames = self.bad = self.nbytes = self.tensors = self.in_place = 0
        self.first_at: float | None = None
        self.faults_at_first = 0
        self.last_at = 0.0
        self.t_decode_frame = self.t_codec = self.t_store = 0.0

    def setup(self, msg: dict[str, Any]) -> None:
        import torch

        n, dtype = msg["tokens"], _torch_dtype(msg["dtype"])
        self.k = self.v = None  # free the previous size first
        slots = -(-n // BLOCK_SIZE) * BLOCK_SIZE
        shape = (msg["layers"], slots, msg["kv_heads"], msg["head_dim"])
        self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.slots = _shuffled_slots(n)
        self.fingerprint = msg["fingerprint"]
        self.reset()

    def on_frame(self, parts: list[Any]) -> None:
        from pdserve.transfer import wire

        t0 = time.monotonic()
        if self.first_at is None:
            self.first_at, self.faults_at_first = t0, _minor_faults()
        try:
            wire.peek_header(parts)
            frame = wire.decode_frame(parts, fingerprint=self.fingerprint)
        except wire.WireError:
            self.bad += 1
            return
        t1 = time.monotonic()
        h = frame.header
        assert self.k is not None and self.v is not None and self.slots is not None
        slots = self.slots[h.token_start : h.token_end]
        layers = frame.layers()
        t_codec = t_store = 0.0
        received = [_address_range(p) for p in parts]
        while True:
            ta = time.monotonic()
            item = next(layers, None)
            tb = time.monotonic()
            if item is None:
                break
            layer, k, v = item
            self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
            self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))
            t_codec += tb - ta
            t_store += time.monotonic() - tb
            self.tensors += 2
            self.in_place += sum(_inside(t.data_ptr(), received) for t in (k, v))
        self.t_decode_frame += t1 - t0
        self.t_codec += t_codec
        self.t_store += t_store
        self.frames += 1
        self.nbytes += h.header_len + h.payload_len
        self.last_at = time.monotonic()

    def report(self) -> dict[str, Any]:
        return {
            "frames": self.frames,
            "bad": self.bad,
            "nbytes": self.nbytes,
            "first_frame_at": self.first_at or 0.0,
            "last_frame_at": self.last_at,
            "decode_frame_s": self.t_decode_frame,
            "codec_decode_s": self.t_codec,
            "store_s": self.t_store,
            "tensors": self.tensors,
            "in_place": self.in_place,
            "minor_faults": _minor_faults() - self.faults_at_first if self.first_at else 0,
        }


def _address_range(part: Any) -> tuple[int, int]:
    import numpy as np

    arr = np.frombuffer(part, dtype=np.uint8)
    return arr.ctypes.data, arr.ctypes.data + arr.nbytes


def _inside(ptr: int, ranges: list[tuple[int, int]]) -> bool:
    """Whether a decoded tensor's memory lies in a received buffer (a view, not a copy)."""
    return any(lo <= ptr < hi for lo, hi in ranges)


def _serve_zmq(conn: Connection, transport: str, ctx: zmq.Context | None = None) -> None:
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
    store, reader = _Store(), ShmReader()
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


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
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
    buf, head = bytearray(0), bytearray(_SOCK_HEAD.size)
    try:
        while True:
            _recv_exact(peer, memoryview(head))
            op, n = _SOCK_HEAD.unpack(head)
            if op == _OP_STOP:
                break
            if op == _OP_SETUP:
                buf = bytearray(n)
            else:
                _recv_exact(peer, memoryview(buf)[:n])
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
            _serve_zmq(conn, name)
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


# --------------------------------------------------------------------------- sender side


class ZmqLink:
    """Sender of the real transport: a DEALER from `connect_sender`, frames as `PrefillSide`."""

    def __init__(self, transport: str, endpoint: str, ctx: zmq.Context) -> None:
        from pdserve.transfer.shm import ShmRing
        from pdserve.transfer.transports import connect_sender

        self.sock = connect_sender(ctx, endpoint, "bench-P")
        self.ring = ShmRing(SHM_MB << 20) if transport == "shm" else None
        self.runs = 0

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        import msgpack

        from pdserve.transfer.transports import MSG

        self.sock.send_multipart([MSG, msgpack.packb(msg)])
        return self._reply()

    def _reply(self) -> dict[str, Any]:
        import msgpack

        if not self.sock.poll(int(ACK_TIMEOUT_S * 1000)):
            raise RuntimeError(f"the receiver did not answer within {ACK_TIMEOUT_S:g}s")
        parts = self.sock.recv_multipart()
        reply: dict[str, Any] = msgpack.unpackb(parts[1])
        return reply

    def send_batch(
        self, keys: torch.Tensor, values: torch.Tensor, codec: str, fp: bytes
    ) -> tuple[float, dict[str, float], int, int]:
        """Seconds from the first encode to the ack, the stages, wire bytes, inline frames."""
        import msgpack

        from pdserve.transfer import wire
        from pdserve.transfer.transports import FRAME, MSG, SHM_FRAME

        self.runs += 1
        rid = f"bench-{self.runs}"
        layers = keys.shape[0]
        t_encode = t_pack = t_send = 0.0
        nbytes = inline = 0
        faults = _minor_faults()
        t0 = time.monotonic()
        for layer in range(layers):
            ta = time.monotonic()
            parts = wire.encode_frame(rid, layer, 0, [keys[layer]], [values[layer]], codec, fp)
            tb = time.monotonic()
            nbytes += wire.frame_nbytes(parts)
            packed: list[Any] = [FRAME, *parts]
            if self.ring is not None:
                ref = self.ring.put(rid, parts[1:])
                if ref is not None:
                    packed = [SHM_FRAME, parts[0], ref]
                else:
                    inline += 1
            tc = time.monotonic()
            self.sock.send_multipart(packed, copy=False)
            td = time.monotonic()
            t_encode, t_pack, t_send = t_encode + tb - ta, t_pack + tc - tb, t_send + td - tc
        sent_at = time.monotonic()
        self.sock.send_multipart([MSG, msgpack.packb({"op": "done", "frames": layers})])
        ack = self._reply()
        t1 = time.monotonic()
        faults = _minor_faults() - faults
        if self.ring is not None:
            self.ring.release(rid)
        if ack.get("frames") != layers or ack.get("bad"):
            raise RuntimeError(f"the receiver got {ack.get('frames')}/{layers} frames: {ack}")
        stages = {
            "encode_s": t_encode,
            "pack_s": t_pack,
            "send_s": t_send,
            "sender_done_s": sent_at - t0,
            "first_frame_s": ack["first_frame_at"] - t0,
            "last_frame_s": ack["last_frame_at"] - t0,
            "decode_frame_s": ack["decode_frame_s"],
            "codec_decode_s": ack["codec_decode_s"],
            "store_s": ack["store_s"],
            "total_s": t1 - t0,
            "sender_faults": faults,
            "receiver_faults": ack["minor_faults"],
            "in_place_tensors": ack["in_place"],
            "decoded_tensors": ack["tensors"],
        }
        return t1 - t0, stages, nbytes, inline

    def close(self) -> None:
        self.sock.close(0)
        if self.ring is not None:
            self.ring.close()


def _setup_msg(layout: Layout, n: int, fp: bytes) -> dict[str, Any]:
    return {
        "op": "setup",
        "tokens": n,
        "layers": layout.layers,
        "kv_heads": layout.kv_heads,
        "head_dim": layout.head_dim,
        "dtype": layout.dtype,
        "fingerprint": fp,
    }


def measure_transport(
    transport: str,
    endpoint: str,
    ctx: zmq.Context,
    layout: Layout,
    sizes: Sequence[int],
    codecs: Sequence[str],
    repeats: int,
) -> list[ThroughputRow]:
    fp = _fingerprint(layout)
    link = ZmqLink(transport, endpoint, ctx)
    rows = []
    try:
        for n in sizes:
            keys, values = _random_kv(layout, n, SEED + n)
            if link.request(_setup_msg(layout, n, fp)).get("op") != "ready":
                raise RuntimeError("the receiver did not set up")
            for codec in codecs:
                _log(f"{transport} {codec} {n} tokens")
                runs = [link.send_batch(keys, values, codec, fp) for _ in range(repeats + 1)][1:]
                rows.append(_throughput_row(transport, codec, n, layout, runs))
            del keys, values
        link.request({"op": "stop"})
    finally:
        link.close()
    return rows


def _throughput_row(
    transport: str,
    codec: str,
    n: int,
    layout: Layout,
    runs: list[tuple[float, dict[str, float], int, int]],
) -> ThroughputRow:
    samples = [r[0] for r in runs]
    median = sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]  # a real run, not a mean
    seconds, wire = statistics.median(samples), median[2]
    raw = n * layout.bytes_per_token
    return ThroughputRow(
        transport=transport,
        codec=codec,
        tokens=n,
        frames=layout.layers,
        raw_bytes=raw,
        wire_bytes=wire,
        seconds=seconds,
        samples_s=samples,
        effective_gbs=raw / seconds / 1e9,
        wire_gbs=wire / seconds / 1e9,
        inline_frames=max(r[3] for r in runs),
        stages=median[1],
    )


def run_throughput(args: argparse.Namespace, layout: Layout) -> list[ThroughputRow]:
    import zmq

    rows: list[ThroughputRow] = []
    receiver = ReceiverProcess()
    try:
        for transport in args.transports:
            if transport == "inproc":
                rows += _inproc_throughput(args, layout)
                continue
            endpoint = receiver.serve("zmq", transport)
            ctx = zmq.Context()
            try:
                rows += measure_transport(
                    transport, endpoint, ctx, layout, args.sizes, args.codecs, args.repeats
                )
            finally:
                ctx.term()
    finally:
        receiver.close()
    return rows


def _inproc_throughput(args: argparse.Namespace, layout: Layout) -> list[ThroughputRow]:
    """inproc needs one zmq context in one process: the receiver is a thread here."""
    import multiprocessing

    import zmq

    ctx = zmq.Context()
    parent, child = multiprocessing.Pipe()
    thread = threading.Thread(target=_serve_zmq, args=(child, "inproc", ctx), daemon=True)
    thread.start()
    try:
        endpoint = parent.recv()
        return measure_transport(
            "inproc", endpoint, ctx, layout, args.sizes, args.codecs, args.repeats
        )
    finally:
        thread.join(timeout=10)
        ctx.term()
