"""`pdserve bench attention`: decode step time with the paged (in-place) attention kernel against
the gather reference, side by side in one run, on the same model, cache and block tables.

Method. One engine is loaded (default model, float32, `--threads`). For every batch B and
context C, B decode rows are laid out over a shuffled block pool (non-contiguous tables, as a
busy cache has them) and one decode step — all layers, the LM head included, the scheduler and
sampler left out — is timed through a `ModelRunner` per backend over the same weights and KV
tensors: the median of `--repeats` steps after a warm-up step, the two backends interleaved
step by step so a burst of load from other processes hits both alike. Then:
  * attention ms: a second step with the attention function (cache write + attention, every
    layer) timed inside, summed, median over repeats; share = attention / step;
  * KV read ms: the bytes of K and V the step must read (B x C x 2 x layers x kv_heads x
    head_dim x 4) over the read bandwidth measured in the same run (`torch.sum` over a 512 MiB
    float32 buffer, the best of 3); the issue's target is attention <= 2x this at 1k;
  * tokens/s = B / step; batch scaling = tokens/s at B over tokens/s at B=1, same context;
  * overhead: the same decode step on a tiny random 2-layer model (hidden 64, vocab 512) at
    batch 1 and 16 tokens of context: nearly no FLOPs and bytes, so its time is the fixed cost
    of a step (Python, metadata, per-op dispatch).
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from pdserve.bench.harness import report, timing

BACKENDS = ("gather", "paged")
BLOCK_SIZE = 16
BANDWIDTH_MIB = 512


@dataclass(frozen=True)
class Cell:
    backend: str
    batch: int
    context: int
    step_ms: float
    attention_ms: float
    kv_read_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_ms * 1e3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 2048])
    p.add_argument("--repeats", type=int, default=5, help="timed steps per cell (median)")
    p.add_argument("--output", type=Path, default=Path("docs/benchmarks/attention.md"))
    p.add_argument("--json", type=Path, default=None)


def read_gbs(repeats: int = 3) -> float:
    import torch

    x = torch.ones(BANDWIDTH_MIB * 2**20 // 4)
    best = min(timing.timed(lambda: x.sum()) for _ in range(repeats + 1))
    return x.nbytes / best / 1e9


def decode_step(batch: int, context: int, num_blocks: int, seed: int) -> Any:
    """A SchedulerOutput of `batch` decodes at `context` tokens over shuffled block tables."""
    from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput

    per = -(-(context + 1) // BLOCK_SIZE)
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    return SchedulerOutput(
        [
            ScheduledRequest(f"r{i}", [7], context, pool[i * per : (i + 1) * per], sample=True)
            for i in range(batch)
        ]
    )


@contextmanager
def timed_attention(sink: list[float]) -> Iterator[None]:
    """Time every call of the model's attention function (cache write included) into `sink`."""
    from pdserve.engine.models import llama

    inner = llama.paged_attention

    def wrapper(*a: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*a)
        sink.append(time.perf_counter() - t0)
        return out

    llama.paged_attention = wrapper  # type: ignore[assignment]
    try:
        yield
    finally:
        llama.paged_attention = inner  # type: ignore[assignment]


def measure(engine: Any, batch: int, context: int, repeats: int, gbs: float) -> list[Cell]:
    import torch

    from pdserve.engine.model_runner import ModelRunner

    arch, cache = engine.arch, engine.cache
    out = decode_step(batch, context, cache.num_blocks, seed=batch * 7919 + context)
    kv_bytes = batch * context * 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4
    runners = {b: ModelRunner(engine.model, cache, torch.device("cpu"), b) for b in BACKENDS}
    steps: dict[str, list[float]] = {b: [] for b in BACKENDS}
    attn: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for r in runners.values():
        r.execute(out)  # warm-up
    for _ in range(repeats):  # interleaved, so a burst of load hits both backends alike
        for b, r in runners.items():
            steps[b].append(timing.timed(partial(r.execute, out)))
            sink: list[float] = []
            with timed_attention(sink):
                r.execute(out)
            attn[b].append(sum(sink))
    return [
        Cell(
            b,
            batch,
            context,
            statistics.median(steps[b]) * 1e3,
            statistics.median(attn[b]) * 1e3,
            kv_bytes / gbs / 1e6,
        )
        for b in BACKENDS
    ]


def tiny_overhead(repeats: int) -> dict[str, float]:
    """Batch-1 decode step (16 tokens of context) of a random 2-layer, hidden-64 Llama."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pdserve import LLM
    from pdserve.engine.model_runner import ModelRunner

    with tempfile.TemporaryDirectory() as tmp:
        cfg = LlamaConfig(
            vocab_size=512,  # a small LM head: the step's time is its fixed cost, not matmuls
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(tmp, safe_serialization=True)
        from pdserve.engine import loader

        loader.load_tokenizer(loader.resolve_model(None)).save_pretrained(tmp)
        eng = LLM(tmp, block_size=BLOCK_SIZE, num_blocks=64).engine
    out = decode_step(1, 16, 64, seed=1)
    runners = {b: ModelRunner(eng.model, eng.cache, torch.device("cpu"), b) for b in BACKENDS}
    steps: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for _ in range(max(50, repeats)):
        for b, r in runners.items():
            steps[b].append(timing.timed(partial(r.execute, out)))
    return {b: statistics.median(steps[b][5:]) * 1e3 for b in BACKENDS}  # first 5: warm-up


def run(args: argparse.Namespace) -> int:
    import torch

    from pdserve import LLM

    torch.set_num_threads(args.threads)
    tokens = max(args.batch_sizes) * (max(args.contexts) + BLOCK_SIZE)
    num_blocks = -(-tokens // BLOCK_SIZE) + 1
    engine = LLM(
        args.model,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        threads=args.threads,
        quantization="none",  # float32, as the method above says (auto would run gguf)
    )
    gbs = read_gbs()
    cells: list[Cell] = []
    for b in args.batch_sizes:
        for c in args.contexts:
            print(f"attention bench: B={b} context={c}", file=sys.stderr, flush=True)
            cells += measure(engine.engine, b, c, args.repeats, gbs)
    overhead = tiny_overhead(args.repeats)
    info = report.machine_info(args.threads, read_gbs=round(gbs, 2))
    md = render(args, cells, overhead, info)
    data = {"machine": info, "cells": [asdict(c) for c in cells], "tiny_step_ms": overhead}
    report.write_report(md, data, args.output, args.json)
    return 0


def _cell(cells: list[Cell], backend: str, b: int, c: int) -> Cell:
    return next(x for x in cells if (x.backend, x.batch, x.context) == (backend, b, c))


def render(args: argparse.Namespace, cells: list[Cell], tiny: dict[str, float], info: dict) -> str:
    cmd = report.command_line(sys.argv[3:], "pdserve bench attention")
    lines = [
        "# Paged attention: in-place kernel vs gather",
        "",
        f"`{cmd}` — {datetime.date.today()}, {info['cpu']}, {info['cores']} cores, "
        f"{args.threads} threads, torch {info['torch']}, load average "
        f"{report.load_text(info['load_average'])} at the end, "
        f"read bandwidth {info['read_gbs']} GB/s.",
        "",
        "Decode step (all layers + LM head, no scheduler/sampler), median ms; attention = cache "
        "write + attention summed over layers; KV read = KV bytes / read bandwidth.",
        "",
        "| B | context | gather step | paged step | speed-up | gather attn | paged attn "
        "| paged attn share | KV read | paged attn / KV read |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in args.batch_sizes:
        for c in args.contexts:
            g, p = _cell(cells, "gather", b, c), _cell(cells, "paged", b, c)
            lines.append(
                f"| {b} | {c} | {g.step_ms:.1f} | {p.step_ms:.1f} | {g.step_ms / p.step_ms:.2f}x "
                f"| {g.attention_ms:.1f} | {p.attention_ms:.1f} "
                f"| {p.attention_ms / p.step_ms:.0%} | {p.kv_read_ms:.1f} "
                f"| {p.attention_ms / p.kv_read_ms:.1f}x |"
            )
    lines += ["", "Targets (issue 12):", ""]
    c_lo, c_hi = min(args.contexts), max(args.contexts)
    for backend in BACKENDS:
        if 1 in args.batch_sizes:
            ratio = _cell(cells, backend, 1, c_hi).step_ms / _cell(cells, backend, 1, c_lo).step_ms
            lines.append(
                f"- {backend}: B=1 step at {c_hi} / at {c_lo}: {ratio:.2f}x (target <= 1.3x)"
            )
        if 1 in args.batch_sizes and 8 in args.batch_sizes:
            for c in args.contexts:
                s = (
                    _cell(cells, backend, 8, c).tokens_per_s
                    / _cell(cells, backend, 1, c).tokens_per_s
                )
                lines.append(
                    f"- {backend}: tokens/s B=8 / B=1 at context {c}: {s:.2f}x (target >= 5x)"
                )
    lines += [
        "",
        "Fixed cost of a step (tiny random 2-layer model, hidden 64, vocab 512, B=1, 16 tokens "
        "of context): " + ", ".join(f"{k} {v:.2f} ms" for k, v in tiny.items()) + ".",
        "",
    ]
    return "\n".join(lines)
