"""What the transports of `pdserve bench transfer` are measured against, on the same machine in
the same run: raw baselines moving the same bytes (memcpy x2 through shared memory, one torch
copy, plain TCP and Unix sockets) and the CPU cost of each codec in this process (see
`transfer_bench`'s module docstring)."""

from __future__ import annotations

import argparse
import socket
import statistics
from typing import TYPE_CHECKING, Any

from pdserve.bench.harness import report, timing
from pdserve.bench.transfer.transfer_kv import (
    Store,
    encode_layers,
    fingerprint,
    random_kv,
    setup_msg,
)
from pdserve.bench.transfer.transfer_receiver import ReceiverProcess, recv_exact
from pdserve.bench.transfer.transfer_results import (
    BASELINE_OF,
    OP_DATA,
    OP_SETUP,
    OP_STOP,
    SEED,
    SOCK_HEAD,
    BaselineRow,
    CodecRow,
    Layout,
    ThroughputRow,
)

if TYPE_CHECKING:
    import torch


def _frame_bytes(layout: Layout, n: int) -> list[bytes]:
    """Each layer's "none" frame as one bytes object: what the baselines move."""
    keys, values = random_kv(layout, n, SEED + n)
    frames = encode_layers("baseline", keys, values, "none", fingerprint(layout))
    return [b"".join(bytes(p) for p in parts) for parts in frames]


def _copy_in_out(srcs: list[Any], ring: Any, dest: Any) -> None:
    pos = 0
    for src in srcs:
        end = pos + src.size
        ring[pos:end] = src  # sender: into shared memory
        dest[pos:end] = ring[pos:end]  # receiver: out of it into the tensor
        pos = end


def memcpy_baselines(layout: Layout, n: int, repeats: int) -> list[BaselineRow]:
    import functools
    from multiprocessing import shared_memory

    import numpy as np
    import torch

    chunks = _frame_bytes(layout, n)
    total = sum(len(c) for c in chunks)
    raw = n * layout.bytes_per_token
    srcs = [np.frombuffer(c, dtype=np.uint8) for c in chunks]
    dest = torch.empty(total, dtype=torch.uint8)
    seg = shared_memory.SharedMemory(create=True, size=total)
    assert seg.buf is not None
    ring = np.ndarray((total,), dtype=np.uint8, buffer=seg.buf)
    try:
        x2 = timing.sample_times(functools.partial(_copy_in_out, srcs, ring, dest.numpy()), repeats)
    finally:
        del ring  # no view may outlive the segment
        seg.close()
        seg.unlink()
    src_t = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    one = timing.sample_times(functools.partial(dest.copy_, src_t), repeats)
    return [
        BaselineRow("memcpy x2", n, raw, statistics.median(x2), x2),
        BaselineRow("copy", n, raw, statistics.median(one), one),
    ]


def socket_baseline(
    receiver: ReceiverProcess, family: str, layout: Layout, n: int, repeats: int
) -> BaselineRow:
    chunks = _frame_bytes(layout, n)
    total = sum(len(c) for c in chunks)
    address = receiver.serve("socket", family)
    if family == "tcp":
        sock = socket.create_connection(tuple(address))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
    reply = memoryview(bytearray(1))
    try:
        sock.sendall(SOCK_HEAD.pack(OP_SETUP, total))
        recv_exact(sock, reply)

        def once() -> None:
            sock.sendall(SOCK_HEAD.pack(OP_DATA, total))
            for chunk in chunks:
                sock.sendall(chunk)
            recv_exact(sock, reply)

        samples = timing.sample_times(once, repeats)
        sock.sendall(SOCK_HEAD.pack(OP_STOP, 0))
    finally:
        sock.close()
    kind = "tcp socket" if family == "tcp" else "unix socket"
    return BaselineRow(kind, n, n * layout.bytes_per_token, statistics.median(samples), samples)


def run_baselines(args: argparse.Namespace, layout: Layout) -> list[BaselineRow]:
    rows: list[BaselineRow] = []
    families = [f for f in ("tcp", "ipc") if f in args.transports]
    receiver = ReceiverProcess() if families else None
    try:
        for n in args.sizes:
            report.log(f"baselines {n} tokens")
            rows += memcpy_baselines(layout, n, args.repeats)
            for family in families:
                assert receiver is not None
                rows.append(socket_baseline(receiver, family, layout, n, args.repeats))
    finally:
        if receiver is not None:
            receiver.close()
    return rows


def attach_baselines(rows: list[ThroughputRow], baselines: list[BaselineRow]) -> None:
    by_key = {(b.kind, b.tokens): b for b in baselines}
    for r in rows:
        base = by_key.get((BASELINE_OF[r.transport], r.tokens))
        if base is None:
            continue
        r.baseline, r.baseline_gbs = base.kind, base.gbs
        if r.codec == "none":
            r.ratio = r.effective_gbs / base.gbs


def measure_codecs(args: argparse.Namespace, layout: Layout) -> list[CodecRow]:
    fp, rows = fingerprint(layout), []
    for n in args.sizes:
        keys, values = random_kv(layout, n, SEED + n)
        store = Store()
        store.setup(setup_msg(layout, n, fp))
        for codec in args.codecs:
            report.log(f"codec {codec} {n} tokens")
            rows.append(_codec_cost(codec, keys, values, fp, store, args.repeats))
    return rows


def _codec_cost(
    codec: str, keys: torch.Tensor, values: torch.Tensor, fp: bytes, store: Store, repeats: int
) -> CodecRow:
    from pdserve.transfer import wire

    frames = encode_layers("codec", keys, values, codec, fp)

    def encode() -> None:
        encode_layers("codec", keys, values, codec, fp)

    def decode() -> None:
        for parts in frames:
            store.on_frame(parts)

    n, layers = keys.shape[1], keys.shape[0]
    raw = 2 * keys[0].nbytes * layers
    return CodecRow(
        codec,
        n,
        raw,
        sum(wire.frame_nbytes(p) for p in frames),
        statistics.median(timing.sample_times(encode, repeats)),
        statistics.median(timing.sample_times(decode, repeats)),
    )
