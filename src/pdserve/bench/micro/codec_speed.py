"""`pdserve bench codec`'s speed half: encode, decode and whole-frame GB/s of each codec on
random KV of the model's layout."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.bench.harness import timing

if TYPE_CHECKING:
    import torch

    from pdserve.engine.engine import LLMEngine


@dataclass
class CodecSpeed:
    codec: str
    encode_gbs: float  # uncompressed KV bytes / encode time
    decode_gbs: float  # uncompressed KV bytes / decode time
    frame_gbs: float  # uncompressed KV bytes / (encode_frame + decode_frame + layers())
    ratio: float  # encoded / uncompressed bytes


def measure_speed(
    engine: LLMEngine, tokens: int, codecs: Sequence[str], repeats: int
) -> list[CodecSpeed]:
    import torch

    arch = engine.arch
    gen = torch.Generator().manual_seed(0)
    shape = (tokens, arch.num_kv_heads, arch.head_dim)
    kv = [torch.randn(shape, generator=gen).to(engine.dtype) for _ in range(2 * arch.num_layers)]
    return [_codec_speed(name, kv, repeats) for name in codecs]


def _codec_speed(name: str, kv: list[torch.Tensor], repeats: int) -> CodecSpeed:
    from pdserve.transfer.codecs import get_codec
    from pdserve.transfer.wire import decode_frame, encode_frame, frame_nbytes

    codec = get_codec(name)
    raw = sum(t.nbytes for t in kv)
    n, heads, dim = kv[0].shape
    encoded = [codec.encode(t) for t in kv]

    def gbs(fn: Callable[[], object]) -> float:
        return raw / timing.median_seconds(fn, repeats) / 1e9

    def frame_round_trip() -> None:
        parts = encode_frame("speed", 0, 0, kv[0::2], kv[1::2], name, bytes(8))
        for _ in decode_frame(parts).layers():
            pass

    return CodecSpeed(
        codec=name,
        encode_gbs=gbs(lambda: [codec.encode(t) for t in kv]),
        decode_gbs=gbs(lambda: [codec.decode(b, n, heads, dim, kv[0].dtype) for b in encoded]),
        frame_gbs=gbs(frame_round_trip),
        ratio=frame_nbytes(encoded) / raw,
    )
