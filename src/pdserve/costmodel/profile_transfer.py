"""The profile's KV-transfer points (costmodel/profile.py runs them): one request's KV over a
loopback ZeroMQ pair, split into the wire (`transfer`) and the decode worker's own receive.

transfer (bytes, s) and receive (tokens, s): one request's KV for n tokens (the engine's layout,
random values) from `encode_frame` per layer, over a loopback tcp DEALER -> ROUTER pair, then
what a decode worker does with each frame on its own loop: `decode_frame` and `engine.write_kv`
into cache slots. The receive sample is that last part alone (D's work: it delays D's next
step); the transfer sample is the rest (encoding and the wire). Bytes = raw KV bytes (n * bytes
per token), the number a caller can compute; frame headers are in the fixed terms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pdserve.costmodel.model import CostModel

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine

TransferSample = tuple[int, float]  # bytes, seconds
ReceiveSample = tuple[int, float]  # tokens, seconds


def kv_bytes_per_token(engine: LLMEngine) -> int:
    """Bytes of one token's K and V in the engine's cache (its --kv-cache-dtype, not the
    model's dtype): what a hand-off moves and what sizes the simulator's KV memory."""
    arch = engine.arch
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * engine.cache.dtype.itemsize


def measure_transfer(
    engine: LLMEngine, tokens: Sequence[int], repeats: int, log: Callable[[str], None]
) -> tuple[list[TransferSample], list[ReceiveSample]]:
    """One (bytes, s) transfer and (tokens, s) receive sample per length in `tokens`, each the
    median of `repeats`."""
    import zmq

    from pdserve.transfer import transports

    ctx = zmq.Context()
    receiver, endpoint = transports.bind_receiver(
        ctx, transports.ZMQ_TRANSPORTS["tcp"], "127.0.0.1", 0, "profile-d"
    )
    sender = transports.connect_sender(ctx, endpoint, "profile-p")
    try:
        link = _Loopback(engine, sender, receiver)
        link.send(min(tokens))  # warm-up: connects the pair
        samples, received = [], []
        for n in tokens:
            runs = [link.send(n) for _ in range(repeats)]
            s = statistics.median(t - r for t, r in runs)
            r = statistics.median(r for _, r in runs)
            log(f"transfer {n} tokens: {s * 1e3:.1f} ms, then D receives in {r * 1e3:.1f} ms")
            samples.append((n * kv_bytes_per_token(engine), s))
            received.append((n, r))
        return samples, received
    finally:
        sender.close(0)
        receiver.close(0)
        ctx.term()


class _Loopback:
    """One request's KV, layer by layer, encoded, sent, received, decoded and stored into the
    engine's cache as a decode worker stores it (`engine.write_kv`). The slots are the cache's
    first n (wrapping): nothing reads this engine's cache after the transfer points."""

    def __init__(self, engine: LLMEngine, sender: Any, receiver: Any) -> None:
        layout = engine.kv_layout
        self.engine = engine
        self.layers, self.heads, self.dim = layout.num_layers, layout.num_kv_heads, layout.head_dim
        self.dtype = layout.dtype
        self.fingerprint = engine.kv_layout.fingerprint()
        self.sender, self.receiver = sender, receiver
        self.slots_total = engine.kv_manager.num_blocks * engine.kv_manager.block_size

    def send(self, n: int) -> tuple[float, float]:
        """(seconds from the first encode to the last stored layer, of which D's receive)."""
        import torch

        from pdserve.transfer import wire

        keys = torch.randn(self.layers, n, self.heads, self.dim).to(self.dtype)
        values = torch.randn_like(keys)
        slots = torch.arange(n) % self.slots_total
        t0 = time.perf_counter()
        for layer in range(self.layers):
            parts = wire.encode_frame(
                "profile", layer, 0, [keys[layer]], [values[layer]], "none", self.fingerprint
            )
            self.sender.send_multipart(parts, copy=False)
        receive = 0.0
        for _ in range(self.layers):
            _, *parts = self.receiver.recv_multipart(copy=False)
            r0 = time.perf_counter()
            frame = wire.decode_frame([p.buffer for p in parts], fingerprint=self.fingerprint)
            for layer, k, v in frame.layers():
                self.engine.write_kv(slots, layer, k, v)
            receive += time.perf_counter() - r0
        return time.perf_counter() - t0, receive


def transfer_errors(
    fitted: CostModel, samples: Sequence[TransferSample], received: Sequence[ReceiveSample]
) -> dict[str, float]:
    out = {}
    rel = [abs(fitted.transfer_s(n) - s) / s for n, s in samples]
    if rel:
        out["transfer_p50"] = statistics.median(rel)
    rel = [abs(fitted.receive_s(n) - s) / s for n, s in received if s > 0]
    if rel:
        out["receive_p50"] = statistics.median(rel)
    return out
