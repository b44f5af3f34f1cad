"""The sending end of a `pdserve bench transfer` link (what `PrefillSide` does per layer: encode
a frame, put shm payloads in the ring, `send_multipart`) and the throughput part of the bench:
each transport x codec x size against a `ReceiverProcess`, timed stage by stage."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdserve.bench.harness import report
from pdserve.bench.transfer.transfer_kv import fingerprint, minor_faults, random_kv, setup_msg
from pdserve.bench.transfer.transfer_receiver import ReceiverProcess, serve_zmq
from pdserve.bench.transfer.transfer_results import (
    ACK_TIMEOUT_S,
    SEED,
    SHM_MB,
    Layout,
    ThroughputRow,
)

if TYPE_CHECKING:
    import torch
    import zmq


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
        faults = minor_faults()
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
        faults = minor_faults() - faults
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


def measure_transport(
    transport: str,
    endpoint: str,
    ctx: zmq.Context,
    layout: Layout,
    sizes: Sequence[int],
    codecs: Sequence[str],
    repeats: int,
) -> list[ThroughputRow]:
    fp = fingerprint(layout)
    link = ZmqLink(transport, endpoint, ctx)
    rows = []
    try:
        for n in sizes:
            keys, values = random_kv(layout, n, SEED + n)
            if link.request(setup_msg(layout, n, fp)).get("op") != "ready":
                raise RuntimeError("the receiver did not set up")
            for codec in codecs:
                report.log(f"{transport} {codec} {n} tokens")
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
    thread = threading.Thread(target=serve_zmq, args=(child, "inproc", ctx), daemon=True)
    thread.start()
    try:
        endpoint = parent.recv()
        return measure_transport(
            "inproc", endpoint, ctx, layout, args.sizes, args.codecs, args.repeats
        )
    finally:
        thread.join(timeout=10)
        ctx.term()
