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

from pdserve.bench import common
from pdserve.bench.micro.engine_results import (
    BANDWIDTH_MIB,
    MATMUL_N,
    SEED,
    WARMUP_STEPS,
    DecodePoint,
    ModelCost,
    Roofline,
    Row,
    log,
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
    sum_gbs = x.nbytes / common.median_seconds(lambda: x.sum(), repeats) / 1e9
    n = math.isqrt(x.numel())
    matrix, vector = x[: n * n].view(n, n), torch.ones(n)
    matvec_gbs = (
        matrix.nbytes / common.median_seconds(lambda: torch.mv(matrix, vector), repeats) / 1e9
    )
    dst = torch.empty_like(x)
    copy_gbs = 2 * x.nbytes / common.median_seconds(lambda: dst.copy_(x), repeats) / 1e9
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
    seconds = common.median_seconds(lambda: torch.matmul(a, b, out=out), repeats)
    return 2 * n**3 / seconds / 1e9


# --------------------------------------------------------------------------- pdserve


def build_engine(
    args: argparse.Namespace,
    threads: int,
    quantization: str,
    kv_cache_dtype: str = "auto",
    decode_matmul: str = "auto",
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
    _prefill_once(engine, common.random_ids(gen, n, engine.arch.vocab_size))  # warm-up
    return [
        _prefill_once(engine, common.random_ids(gen, n, engine.arch.vocab_size))
        for _ in range(repeats)
    ]


def _prefill_once(engine: LLMEngine, ids: list[int]) -> float:
    engine.add_request(ids, _greedy(1))
    seconds = common.timed(engine.step)
    if engine.has_unfinished_requests():
        raise RuntimeError(f"a {len(ids)}-token prompt did not prefill in one step")
    return seconds


def pdserve_decode(
    engine: LLMEngine, points: list[DecodePoint], repeats: int, gen: torch.Generator
) -> dict[DecodePoint, tuple[list[float], float]]:
    """Per point: seconds per decode step for each timed repeat, and the mean keys attended
    per step. The repeats go round the points (B=1, B=8, B=1, B=8, ...), so the ratios between
    points (batch 8 / batch 1, C=2048 / C=128) compare samples taken minutes apart at most
    rather than a whole point's repeats against another's: on a shared VM whose speed drifts
    by 1.3x between runs, that is what keeps a ratio from measuring the drift."""
    for point in points:
        log(f"pdserve ({engine.quantization}) decode warm-up B={point.batch} C={point.context}")
        _decode_once(engine, point, gen)
    runs: dict[DecodePoint, list[tuple[float, float]]] = {p: [] for p in points}
    for i in range(repeats):
        log(
            f"pdserve ({engine.quantization}) decode repeat {i + 1}/{repeats}, {len(points)} points"
        )
        for point in points:
            runs[point].append(_decode_once(engine, point, gen))
    return {p: ([r[0] for r in rs], rs[0][1]) for p, rs in runs.items()}


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
        ids = common.random_ids(gen, c, arch.vocab_size)
        blocks = engine.reserve_kv(ids, params, rid, c)
        if blocks is None:
            raise RuntimeError("the KV cache is too small for this decode point")
        rids.append(rid)
        slots = engine.kv_slots(list(blocks), 0, c)
        for layer in range(arch.num_layers):
            engine.write_kv(slots, layer, k, v)
        engine.admit_prefilled(rid, common.random_ids(gen, 1, arch.vocab_size), c)
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
        seconds = common.timed(lambda: _decode_step(engine, point.batch), point.steps)
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
        total = common.timed(lambda: _decode_step(engine, point.batch), point.steps)
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


def run_pdserve(
    args: argparse.Namespace,
    engine: LLMEngine,
    cost: ModelCost,
    roof: Roofline,
    label: str | None = None,
) -> list[Row]:
    """Every prefill and decode point on this engine; rows carry `label` (default: the
    engine's quantization) as their variant."""
    import torch

    from pdserve.engine.quant import projection_bytes

    gen = torch.Generator().manual_seed(SEED)
    q = label or engine.quantization
    weight_bytes = projection_bytes(engine.model)
    rows = []
    for n in args.prompt_lens:
        log(f"pdserve ({q}) prefill {n}")
        samples = pdserve_prefill(engine, n, args.repeats, gen)
        rows.append(_prefill_row(n, samples, cost, roof, q))
    points = decode_points(args)
    measured = pdserve_decode(engine, points, args.repeats, gen)
    for point in points:
        samples, ctx = measured[point]
        row = _decode_row(point, samples, ctx, cost, roof, q, weight_bytes)
        if not args.no_attention:
            log(f"pdserve ({q}) attention share B={point.batch} C={point.context}")
            row.attention_share = attention_share(engine, point, gen)
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
