"""`pdserve bench kvpool`: the KV pool's tiers on this machine vs recomputing the same tokens.

For each token count, tier (memory, disk, Redis on loopback) and storage codec, the prompt's
blocks (the default model's block shape and KV dtype, random values) go through a
`TieredKVPool` holding that tier alone, stored as the engine stores them: chunks of C blocks
(C from `--chunk-mb`, as `--kv-pool-chunk-mb` sets it for a worker), the last one partial:
- put: `put()` of every chunk, then `flush()` - the engine-side copy, encoding, checksum and the
  tier's write, all of it (fresh keys each repeat: a tier skips keys it has);
- get: `lookup()` + `get()` of the whole run - the tier's read, verification and decoding into
  new tensors (what a worker then copies into its KV cache is not counted);
- per-chunk get latency: `lookup()` + `get()` of the first chunk alone (one value), as many
  times as the prompt has chunks.
Recompute is the engine's own prefill step for the same number of tokens (prefix caching off).
GB/s count the KV's raw bytes (float32 tensor bytes), whatever the codec stores. The disk is read
right after it was written: the page cache is warm, as it is for a pool's hot prefixes.

The report replaces the `## Tier bandwidth` section of `--output` (other sections stay).
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve import argtypes
from pdserve.bench.harness import report, timing
from pdserve.bench.harness.servers import redis_server
from pdserve.kvpool.api import DEFAULT_CHUNK_MB
from pdserve.percentiles import percentile

DEFAULT_OUTPUT = Path("docs/benchmarks/kvpool.md")
SECTION = "## Tier bandwidth"
TIERS = ("memory", "disk", "redis")
CODECS = ("none", "int8")
BLOCK_SIZE = 16
MB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    timing.add_model_arguments(parser)
    parser.add_argument(
        "--tokens",
        type=argtypes.int_list,
        default=[256, 1536],
        help="prompt lengths to move and to recompute (default: 256,1536)",
    )
    parser.add_argument(
        "--tiers", type=argtypes.subset(TIERS), default=list(TIERS), help="default: all"
    )
    parser.add_argument(
        "--codecs", type=argtypes.subset(CODECS), default=list(CODECS), help="default: none,int8"
    )
    parser.add_argument("--repeats", type=argtypes.positive_int, default=5, help="default: 5")
    parser.add_argument(
        "--chunk-mb",
        type=float,
        default=DEFAULT_CHUNK_MB,
        help=f"target stored size of a chunk, MiB (as --kv-pool-chunk-mb; default "
        f"{DEFAULT_CHUNK_MB}: 3 blocks of the default model in float32)",
    )
    parser.add_argument(
        "--disk-dir", default=None, help="disk tier directory (default: a new one under $TMPDIR)"
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="an existing Redis (the bench deletes the keys it wrote); default: start "
        "redis-server on loopback",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--json", type=Path, default=None, help="also write results as JSON")


@dataclass
class Row:
    tier: str
    codec: str
    tokens: int
    blocks: int
    chunk_blocks: int  # C: blocks per stored value
    chunk_mb: float  # a full chunk's stored size
    kv_mb: float  # raw KV bytes moved
    stored_mb: float  # what the tier holds for them
    put_s: float  # medians over repeats
    get_s: float
    get_chunk_ms_p50: float
    get_chunk_ms_p90: float
    put_call_ms_p50: float  # the caller's time in one put() of a chunk (the write is behind it)
    recompute_s: float

    @property
    def put_gbs(self) -> float:
        return self.kv_mb * MB / self.put_s / 1e9

    @property
    def get_gbs(self) -> float:
        return self.kv_mb * MB / self.get_s / 1e9


def run(args: argparse.Namespace) -> int:
    import torch

    if min(args.tokens) < BLOCK_SIZE:
        raise ValueError(f"--tokens must each be >= {BLOCK_SIZE} (one block)")
    date = report.now()
    machine = report.machine_info(args.threads or torch.get_num_threads())
    engine = _engine(args)
    arch = engine.arch
    shape = (arch.num_layers, 2, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    gen = torch.Generator().manual_seed(0)
    recompute = {n: _prefill_seconds(engine, n, args.repeats, gen) for n in args.tokens}
    dtype = str(engine.dtype).removeprefix("torch.")
    del engine
    rows: list[Row] = []
    with _redis(args) as redis_url:
        for tier in args.tiers:
            if tier == "redis" and redis_url is None:
                print("kvpool bench: no redis-server and no --redis-url: Redis not measured")
                continue
            for codec in args.codecs:
                for n in args.tokens:
                    rows.append(
                        _measure(tier, codec, n, shape, dtype, recompute[n], args, redis_url)
                    )
    machine["load_average_end"] = report.load_average()
    model = {"name": arch.name, "block_shape": list(shape), "dtype": dtype}
    model["chunk_mb"] = args.chunk_mb
    head = report.ReportHead(date, _command(args), machine)
    markdown = render(head, model, rows, args.disk_dir or tempfile.gettempdir())
    data = {"head": head.__dict__, "model": model, "rows": [r.__dict__ for r in rows]}
    _write_section(args.output, markdown)
    if args.json:
        report.write_json(args.json, data)
    print(markdown)
    return 0


# ---- recompute ---------------------------------------------------------------------------------
def _engine(args: argparse.Namespace) -> Any:
    from pdserve import LLM

    longest = max(args.tokens)
    llm = LLM(
        args.model,
        threads=args.threads,
        block_size=BLOCK_SIZE,
        num_blocks=-(-(longest + 1) // BLOCK_SIZE) + 2,
        enable_prefix_caching=False,
        max_num_seqs=1,
        max_num_batched_tokens=longest + 1,
    )
    return llm.engine


def _prefill_seconds(engine: Any, n: int, repeats: int, gen: Any) -> float:
    from pdserve.bench.micro.engine_measure import pdserve_prefill

    return statistics.median(pdserve_prefill(engine, n, repeats, gen))


# ---- one tier ----------------------------------------------------------------------------------
def _measure(
    tier_name: str,
    codec: str,
    n_tokens: int,
    shape: tuple[int, ...],
    dtype: str,
    recompute_s: float,
    args: argparse.Namespace,
    redis_url: str | None,
) -> Row:
    import torch

    from pdserve.engine.block_pool import hash_full_blocks
    from pdserve.kvpool import PoolNamespace, TieredKVPool
    from pdserve.kvpool.api import chunk_blocks_for, chunk_spans
    from pdserve.kvpool.values import value_nbytes

    torch_dtype = getattr(torch, dtype)
    block_bytes = value_nbytes(48, shape, torch_dtype, codec)
    c = chunk_blocks_for(args.chunk_mb, block_bytes)
    ns = PoolNamespace("bench", dtype, "bench", BLOCK_SIZE, codec, chunk_blocks=c)
    n_blocks = n_tokens // BLOCK_SIZE
    kv = [torch.randn(shape, dtype=torch_dtype) for _ in range(n_blocks)]
    spans = chunk_spans(0, n_blocks, c)
    puts, gets, per_block, calls = [], [], [], []
    stored = 0
    for rep in range(args.repeats + 1):  # the first is a warm-up
        hashes = hash_full_blocks([rep * 100_003 + i for i in range(n_tokens)], BLOCK_SIZE)
        with _tier(tier_name, args, redis_url) as tier:
            pool = TieredKVPool(ns, [tier], queue_size=n_blocks + c, close_tiers=False)
            try:
                rep_calls: list[float] = []
                put_s = timing.timed(functools.partial(_put_all, pool, hashes, kv, rep_calls))
                get_s = timing.timed(functools.partial(_get_all, pool, hashes))
                first = hashes[: spans[0][1]]
                block_s = [timing.timed(functools.partial(_get_all, pool, first)) for _ in spans]
                usage = pool.stats()["tiers"]
                stored = int(usage[tier_name]["bytes_written"])  # type: ignore[index]
            finally:
                pool.close()
                for _, end in spans:  # a shared Redis keeps nothing of the bench's
                    tier.delete(ns.key(hashes[end - 1]))
        if rep:
            puts.append(put_s)
            gets.append(get_s)
            per_block += block_s
            calls += rep_calls
    return Row(
        tier=tier_name,
        codec=codec,
        tokens=n_tokens,
        blocks=n_blocks,
        chunk_blocks=c,
        chunk_mb=value_nbytes(48, shape, torch_dtype, codec, blocks=c) / MB,
        kv_mb=sum(t.numel() * t.element_size() for t in kv) / MB,
        stored_mb=stored / MB,
        put_s=statistics.median(puts),
        get_s=statistics.median(gets),
        get_chunk_ms_p50=statistics.median(per_block) * 1e3,
        get_chunk_ms_p90=percentile(per_block, 90) * 1e3,
        put_call_ms_p50=statistics.median(calls) * 1e3,
        recompute_s=recompute_s,
    )


def _put_all(pool: Any, hashes: list[bytes], kv: list[Any], calls: list[float]) -> None:
    c = pool.namespace.chunk_blocks
    for p in range(0, len(hashes), c):
        t0 = time.perf_counter()
        if not pool.put(p, hashes[p : p + c], kv[p : p + c]):
            raise RuntimeError("the bench's write-back queue dropped a chunk")
        calls.append(time.perf_counter() - t0)
    if not pool.flush(600.0):
        raise RuntimeError("the pool did not flush within 600 s")


def _get_all(pool: Any, hashes: list[bytes]) -> None:
    if pool.lookup(hashes) != len(hashes):
        raise RuntimeError("a block written by the bench is missing (tier too small?)")
    if len(pool.get(hashes, time.monotonic() + 600.0)) != len(hashes):
        raise RuntimeError("a block written by the bench could not be read")


@contextmanager
def _tier(name: str, args: argparse.Namespace, redis_url: str | None) -> Iterator[Any]:
    from pdserve.kvpool.disk import DiskTier
    from pdserve.kvpool.redis_tier import RedisTier
    from pdserve.kvpool.tiers import MemoryTier

    if name == "memory":
        memory = MemoryTier(4 << 30)
        yield memory
        memory.close()
    elif name == "disk":
        root = Path(tempfile.mkdtemp(prefix="pdserve-kvpool-bench-", dir=args.disk_dir))
        try:
            yield DiskTier(root, 64 << 30)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    else:
        assert redis_url is not None
        tier = RedisTier(redis_url, timeout_s=5.0)
        try:
            yield tier
        finally:
            tier.close()


@contextmanager
def _redis(args: argparse.Namespace) -> Iterator[str | None]:
    """The Redis to measure: --redis-url, else a redis-server started here on loopback."""
    if args.redis_url is not None or "redis" not in args.tiers:
        yield args.redis_url
        return
    if shutil.which("redis-server") is None:
        yield None
        return
    with redis_server("4gb") as url:
        yield url


# ---- report ------------------------------------------------------------------------------------
def _command(args: argparse.Namespace) -> str:
    invoked = report.invoked_as("kvpool")
    if invoked is not None:
        return invoked
    parts = ["pdserve", "bench", "kvpool", "--tokens", ",".join(map(str, args.tokens))]
    parts += ["--tiers", ",".join(args.tiers), "--codecs", ",".join(args.codecs)]
    parts += ["--repeats", str(args.repeats), "--chunk-mb", str(args.chunk_mb)]
    return shlex.join(parts)


def render(head: report.ReportHead, model: dict[str, Any], rows: list[Row], disk: str) -> str:
    m = head.machine
    lines = [
        SECTION,
        "",
        f"Measured {head.date} with `{head.command}` (written by `pdserve bench kvpool`).",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['threads']}, load average "
        f"{report.load_text(m['load_average'])} at start and "
        f"{report.load_text(m['load_average_end'])} at the end "
        "(a shared machine: compare rows of this run with each other).",
        f"Model: {model['name']}, one block = {model['block_shape']} {model['dtype']} "
        f"({_block_kb(model):.0f} KB raw). Disk tier under {disk} ({_fs(disk)}); Redis: "
        "redis-server on loopback, no persistence.",
        "",
        "Values are chunks of C blocks (C = the whole number of blocks nearest "
        f"{model.get('chunk_mb', DEFAULT_CHUNK_MB)} MiB stored, per codec; *chunk MB* = a "
        "full chunk's stored size), "
        "the last one of a prompt partial. *put() call* = the caller's time in one `put()` of "
        "a chunk (median; the write happens behind it on the write-back thread). Put = `put()` "
        "of every chunk + `flush()`; get = `lookup()` + `get()` of the whole run (read, "
        "checksum, decode); get/chunk = the same for one chunk; GB/s of raw KV bytes; "
        "medians of the repeats. Recompute = the engine's prefill step for the same tokens; "
        "*speed-up* = recompute time / get time. Both share this run's load: on a small, busy "
        "machine the prefill (compute-bound, every core) slows down more than the copies do, so "
        "check the recompute column against `docs/benchmarks/engine.md` (a quiet machine) "
        "before quoting a ratio.",
        "",
        "| tier | codec | C | chunk MB | tokens | KV MB | stored MB | put() call ms | put GB/s | "
        "get GB/s | get ms | get/chunk ms p50 (p90) | recompute ms | speed-up vs recompute |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.tier} | {r.codec} | {r.chunk_blocks} | {r.chunk_mb:.2f} | {r.tokens} | "
            f"{r.kv_mb:.1f} | {r.stored_mb:.1f} | "
            f"{r.put_call_ms_p50:.2f} | {r.put_gbs:.2f} | {r.get_gbs:.2f} | {r.get_s * 1e3:.1f} | "
            f"{r.get_chunk_ms_p50:.2f} ({r.get_chunk_ms_p90:.2f}) | {r.recompute_s * 1e3:.0f} | "
            f"{r.recompute_s / r.get_s:.1f}x |"
        )
    return "\n".join([*lines, "", *_summary(rows)]) + "\n"


def _summary(rows: list[Row]) -> list[str]:
    """What the table says, in words (regenerated with it)."""
    if not rows:
        return ["No tier was measured."]
    slowest = min(rows, key=lambda r: r.recompute_s / r.get_s)
    fastest = max(rows, key=lambda r: r.get_gbs)
    calls = sorted(r.put_call_ms_p50 for r in rows)
    return [
        f"Every tier loads a prefix at least {slowest.recompute_s / slowest.get_s:.1f}x faster "
        f"than recomputing it (slowest: {slowest.tier}/{slowest.codec} at {slowest.tokens} "
        f"tokens); the fastest read is {fastest.tier}/{fastest.codec} at "
        f"{fastest.get_gbs:.2f} GB/s. A `put()` costs its caller "
        f"{calls[0]:.2f}-{calls[-1]:.2f} ms per chunk (median per row): the chunk's copy and "
        "the hand-off to the write-back thread."
    ]


def _block_kb(model: dict[str, Any]) -> float:
    import math

    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[model["dtype"]]
    return math.prod(model["block_shape"]) * itemsize / 1024


def _fs(path: str) -> str:
    """The filesystem type of `path`'s mount (from /proc/mounts)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "filesystem unknown"
    real = os.path.realpath(path)
    best = max((m for m in mounts if real.startswith(m[1])), key=lambda m: len(m[1]), default=None)
    return f"{best[2]} on {best[0]}" if best else "filesystem unknown"


def _write_section(output: Path, section: str) -> None:
    """Replace (or append) the `## Tier bandwidth` section of `output`, keeping the rest."""
    text = output.read_text() if output.exists() else "# KV pool benchmarks\n\n"
    start = text.find(SECTION)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + (text[end:] if end >= 0 else "")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
