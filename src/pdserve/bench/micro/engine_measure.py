"""`pdserve bench engine`'s own measurements: the machine's roofline (matmul FLOP/s, read and
copy GB/s) and pdserve's prefill and decode steps, with the attention share of a decode step.
The method and formulas are in `pdserve.bench.micro.engine_bench`."""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from typing import TYPE_CHECKING, Any

from pdserve.bench.harness import report, timing
from pdserve.bench.micro.engine_results import (
    BANDWIDTH_MIB,
    MATMUL_N,
    WARMUP_STEPS,
    DecodePoint,
    Key,
    ModelCost,
    Roofline,
    Row,
)

if TYPE_CHECKING:
    import torch

    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.request import SamplingParams

ROOFLINE_REPEATS = 5
BLOCK_SIZE = 16
_RIDS = itertools.count()


# --------------------------------------------------------------------------- roofline


def measure_roofline(repeats: int = ROOFLINE_REPEATS) -> Roofline:
    import torch

    x = torch.ones(BANDWIDTH_MIB * 2**20 // 4)
    sum_gbs = x.nbytes / timing.median_seconds(lambda: x.sum(), repeats) / 1e9
    n = math.isqrt(x.numel())
    matrix, vector = x[: n * n].view(n, n), torch.ones(n)
    matvec_gbs = (
        matrix.nbytes / timing.median_seconds(lambda: torch.mv(matrix, vector), repeats) / 1e9
    )
    dst = torch.empty_like(x)
    copy_gbs = 2 * x.nbytes / timing.median_seconds(lambda: dst.copy_(x), repeats) / 1e9
    return Roofline(
        matmul_gflops=_matmul_gflops(MATMUL_N, repeats),
        read_gbs=max(sum_gbs, matvec_gbs),
        sum_gbs=sum_gbs,
        matvec_gbs=matvec_gbs,
        copy_gbs=copy_gbs,
    )


def _matmul_gflops(n: int, repeats: int) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    seconds = timing.median_seconds(lambda: torch.matmul(a, b, out=out), repeats)
    return 2 * n**3 / seconds / 1e9


# --------------------------------------------------------------------------- pdserve


def build_engine(
    args: argparse.Namespace,
    threads: int,
    quantization: str,
    kv_cache_dtype: str = "auto",
    decode_matmul: str = "auto",
    prefill_format: str = "auto",
) -> LLMEngine:
    from pdserve import LLM

    decode_len = max(args.contexts) + WARMUP_STEPS + 2 * args.decode_steps + 4
    blocks = max(
        -(-(max(args.prompt_lens) + 1) // BLOCK_SIZE) + 1,
        max(args.batch_sizes) * (-(-decode_len // BLOCK_SIZE) + 1),
    )
    llm = LLM(
        args.model,
        threads=threads,
        block_size=BLOCK_SIZE,
        num_blocks=blocks,
        enable_prefix_caching=False,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=max(*args.prompt_lens, max(args.batch_sizes)),
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        decode_matmul=decode_matmul,
        prefill_format=prefill_format,
        device=args.device,  # cuda: the roofline (MFU/MBU) is still the CPU's
        dtype=args.dtype,
    )
    engine = llm.engine
    if max(args.prompt_lens) >= engine.max_model_len or decode_len >= engine.max_model_len:
        raise ValueError(
            f"the model's context is {engine.max_model_len} tokens; lower --prompt-lens "
            f"(max {max(args.prompt_lens)}) or --contexts + --decode-steps ({decode_len})"
        )
    return engine


def _greedy(max_tokens: int) -> SamplingParams:
    from pdserve import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def pdserve_prefill(engine: LLMEngine, n: int, repeats: int, gen: torch.Generator) -> list[float]:
    """Seconds of the single step that prefills an n-token prompt, per timed repeat."""
    _prefill_once(engine, timing.random_ids(gen, n, engine.arch.vocab_size))  # warm-up
    return [
        _prefill_once(engine, timing.random_ids(gen, n, engine.arch.vocab_size))
        for _ in range(repeats)
    ]


def _prefill_once(engine: LLMEngine, ids: list[int]) -> float:
    engine.add_request(ids, _greedy(1))
    seconds = timing.timed(engine.step)
    if engine.has_unfinished_requests():
        raise RuntimeError(f"a {len(ids)}-token prompt did not prefill in one step")
    return seconds


class PdserveSystem:
    """One pdserve engine (a quantization / KV dtype variant) as a side of the rounds: its
    prompt lengths and decode points, one timed sample at a time."""

    def __init__(
        self, label: str, engine: LLMEngine, args: argparse.Namespace, gen: torch.Generator
    ) -> None:
        self.name = f"pdserve ({label})"
        self.label, self.engine, self.gen = label, engine, gen
        self.keys: list[Key] = [("prefill", n) for n in args.prompt_lens]
        self.keys += [("decode", p) for p in decode_points(args)]
        self.contexts: dict[DecodePoint, float] = {}  # mean keys attended per timed step

    def once(self, key: Key) -> float:
        what = key[1]
        if isinstance(what, DecodePoint):
            seconds, self.contexts[what] = _decode_once(self.engine, what, self.gen)
            return seconds
        return _prefill_once(self.engine, timing.random_ids(self.gen, what, self.vocab))

    @property
    def vocab(self) -> int:
        return self.engine.arch.vocab_size


def admit_decoding(engine: LLMEngine, point: DecodePoint, gen: torch.Generator) -> list[str]:
    """B requests whose first C tokens of KV are in the cache (random values), each with its
    first output token: the next step decodes all of them from context C."""
    import torch

    arch = engine.arch
    c = point.context
    shape = (c, arch.num_kv_heads, arch.head_dim)
    k = torch.randn(shape, generator=gen).to(engine.dtype)
    v = torch.randn(shape, generator=gen).to(engine.dtype)
    params = _greedy(WARMUP_STEPS + 2 * point.steps + 2)  # never finishes inside the window
    rids = []
    for _ in range(point.batch):
        rid = f"bench-decode-{next(_RIDS)}"
        ids = timing.random_ids(gen, c, arch.vocab_size)
        blocks = engine.reserve_kv(ids, params, rid, c)
        if blocks is None:
            raise RuntimeError("the KV cache is too small for this decode point")
        rids.append(rid)
        slots = engine.kv_slots(list(blocks), 0, c)
        for layer in range(arch.num_layers):
            engine.write_kv(slots, layer, k, v)
        engine.admit_prefilled(rid, timing.random_ids(gen, 1, arch.vocab_size), c)
    return rids


def _decode_once(
    engine: LLMEngine, point: DecodePoint, gen: torch.Generator
) -> tuple[float, float]:
    rids = admit_decoding(engine, point, gen)
    try:
        for _ in range(WARMUP_STEPS):
            _decode_step(engine, point.batch)
        requests = engine.scheduler.requests
        computed = statistics.mean(requests[r].num_computed_tokens for r in rids)
        seconds = timing.timed(lambda: _decode_step(engine, point.batch), point.steps)
    finally:
        for rid in rids:
            engine.abort_request(rid)
    return seconds / point.steps, computed + (point.steps + 1) / 2


def attention_share(engine: LLMEngine, point: DecodePoint, gen: torch.Generator) -> float | None:
    """Share of a decode step's wall time spent inside `llama.paged_attention`, measured in a
    separate run of the same steps with that function wrapped by a timer."""
    from pdserve.engine.models import llama

    inner = getattr(llama, "paged_attention", None)
    if inner is None:
        return None
    spent = [0.0]

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    rids = admit_decoding(engine, point, gen)
    llama.paged_attention = timed  # type: ignore[attr-defined]
    try:
        for _ in range(WARMUP_STEPS):
            _decode_step(engine, point.batch)
        spent[0] = 0.0
        total = timing.timed(lambda: _decode_step(engine, point.batch), point.steps)
    finally:
        llama.paged_attention = inner  # type: ignore[attr-defined]
        for rid in rids:
            engine.abort_request(rid)
    return spent[0] / total


def _decode_step(engine: LLMEngine, batch: int) -> None:
    outputs = engine.step()
    if len(outputs) != batch:
        raise RuntimeError(f"a decode step produced {len(outputs)} tokens, expected {batch}")


def decode_points(args: argparse.Namespace) -> list[DecodePoint]:
    return [DecodePoint(b, c, args.decode_steps) for c in args.contexts for b in args.batch_sizes]


def pdserve_rows(
    args: argparse.Namespace,
    system: PdserveSystem,
    samples: dict[Key, list[float]],
    cost: ModelCost,
    roof: Roofline,
) -> list[Row]:
    """The rows of one pdserve variant from its rounds' samples, each decode row with its
    attention share (measured here, after the rounds)."""
    from pdserve.engine.quantize import projection_bytes

    engine, q = system.engine, system.label
    weight_bytes = projection_bytes(engine.model)
    rows = [_prefill_row(n, samples[("prefill", n)], cost, roof, q) for n in args.prompt_lens]
    for point in decode_points(args):
        ctx = system.contexts[point]
        row = _decode_row(point, samples[("decode", point)], ctx, cost, roof, q, weight_bytes)
        if not args.no_attention:
            report.log(f"pdserve ({q}) attention share B={point.batch} C={point.context}")
            row.attention_share = attention_share(engine, point, system.gen)
        rows.append(row)
    return rows


def _prefill_row(
    n: int, samples: list[float], cost: ModelCost, roof: Roofline, quantization: str
) -> Row:
    s = statistics.median(samples)
    mfu = cost.prefill_flops(n) / s / (roof.matmul_gflops * 1e9)
    return Row("prefill", n, s, n / s, mfu, float(n), samples, quantization)


def _decode_row(
    point: DecodePoint,
    samples: list[float],
    ctx: float,
    cost: ModelCost,
    roof: Roofline,
    quantization: str,
    weight_bytes: int,
) -> Row:
    s, b = statistics.median(samples), point.batch
    kv = cost.kv_bytes(b, ctx)
    mbu = (weight_bytes + kv) / s / (roof.read_gbs * 1e9)
    row = Row("decode", b, s, b / s, mbu, ctx, samples, quantization, point.context)
    row.kv_read_s = kv / (roof.read_gbs * 1e9)
    return row
