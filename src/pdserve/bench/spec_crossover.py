"""`pdserve bench spec-crossover`: from which decode batch a speculative verify step stops
paying, on this machine (the default of `disable_by_batch_size`, spec_config.py).

Method. One engine (default model unless `--model`, `--threads`) holds B running requests of
`--context` tokens each. Two steps are timed through its `ModelRunner` on the same KV, the
median of `--repeats` after a warm-up, interleaved so load from other processes hits both:
  * plain: B decode rows;
  * verify: B chunks of 1 + k rows (the last token and k drafts), as speculation runs them.
A verify step yields 1 + a tokens per request where a is the accepted drafts per step, so it
pays while verify / plain < 1 + a. The crossover printed is the smallest B where the ratio
reaches 1 + `--accepted` (a measured acceptance: `pdserve_spec_accepted_tokens_total` over
`pdserve_spec_steps_total` on a running server; 1.0 by default).

`--parts`: where each step's time goes, by native kernel (the projections' matmuls, attention,
the rest), from `cProfile` around the timed steps: what a draft row costs in each part.
`--attention-builds avx2,avx512`: the same steps on each build of the paged attention kernel
this CPU runs, interleaved on the one engine (a row per build and batch).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine import kernels
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--quantization", default="auto", help="projection weights, as `serve --quantization`"
    )
    p.add_argument("--batches", default="1,2,4,8,16,32", help="decode batches to time")
    p.add_argument("--context", type=int, default=1024, help="tokens per request")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4, dest="k")
    p.add_argument("--accepted", type=float, default=1.0, help="accepted drafts per step")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--parts", action="store_true", help="also time each step's kernels by part")
    p.add_argument(
        "--attention-builds",
        default=None,
        help="comma-separated builds of the paged attention kernel to time side by side "
        "(avx2, avx512); default: the one this CPU runs",
    )


def _engine(args: argparse.Namespace, batch: int) -> LLMEngine:
    blocks = batch * (args.context + args.k + 32) // 16 + 16
    cfg = EngineConfig.from_kwargs(
        model=args.model,
        threads=args.threads,
        quantization=args.quantization,
        num_blocks=blocks,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * (1 + args.k)),
    )
    return LLMEngine(cfg)


def _time(
    eng: LLMEngine, drafts: int, repeats: int, parts: dict[str, float] | None = None
) -> float:
    """Median seconds of one forward step of the running requests with `drafts` each;
    `parts`: filled with the mean seconds a step spends per kind of kernel (`_by_part`)."""
    rng = random.Random(0)
    for r in eng.scheduler.running:
        r.spec_token_ids = [rng.randrange(100, 10_000) for _ in range(drafts)]
    out = eng.scheduler.schedule()  # allocates the draft rows' slots; nothing is appended
    eng.runner.execute(out)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        eng.runner.execute(out)
        times.append(time.perf_counter() - t0)
    if parts is not None:
        prof = cProfile.Profile()
        prof.runcall(lambda: [eng.runner.execute(out) for _ in range(repeats)])
        parts.update({k: v / repeats for k, v in _by_part(pstats.Stats(prof)).items()})
    return statistics.median(times)


def _by_part(stats: pstats.Stats) -> dict[str, float]:
    """Seconds in the native kernels by part: `matmul*` (projections, LM head), attention, the
    rest of the profiled time (norms, rope, Python)."""
    parts = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for (_, _, name), row in stats.stats.items():  # type: ignore[attr-defined]
        own = row[2]  # tottime
        part = "matmul" if "matmul" in name else "attention" if "attention" in name else "other"
        parts[part] += own
    return parts


def measure(
    args: argparse.Namespace, eng: LLMEngine, batch: int, builds: list[str | None]
) -> list[dict[str, Any]]:
    """A row per build: plain and verify steps' medians (and parts), builds interleaved."""
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=args.k + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(100, 10_000) for _ in range(args.context)]
        eng.add_request(prompt, params, f"r{i}")
    while any(not r.output_token_ids for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill every request: all decode from here
    times: dict[Any, dict[str, list[float]]] = {b: {"plain": [], "verify": []} for b in builds}
    parts: dict[Any, dict[str, dict[str, float]]] = {b: {"plain": {}, "verify": {}} for b in builds}
    for half in range(2):  # interleaved halves; the parts profiled in the second
        want = half == 1 and args.parts
        for build in builds:
            if build is not None:
                eng.runner.use_attention_build(build)
            for kind, drafts in (("plain", 0), ("verify", args.k)):
                got = parts[build][kind] if want else None
                times[build][kind].append(_time(eng, drafts, args.repeats, got))
    for i in range(batch):
        eng.abort_request(f"r{i}")
    eng.kv_manager.reset_prefix_cache()  # the next batch computes its own prompts
    rows = []
    for build in builds:
        p, v = (statistics.median(times[build][k]) for k in ("plain", "verify"))
        row: dict[str, Any] = {"batch": batch, "plain_ms": p * 1e3, "verify_ms": v * 1e3}
        row["ratio"] = v / p
        if build is not None:
            row["attention_build"] = build
        if args.parts:
            row["parts_ms"] = {
                k: {part: round(t * 1e3, 3) for part, t in ms.items()}
                for k, ms in parts[build].items()
            }
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batches.split(",")]
    builds: list[str | None] = (
        [b.strip() for b in args.attention_builds.split(",")] if args.attention_builds else [None]
    )
    for build in builds:  # refused before the model loads, not after its prompts
        if build is not None and not kernels.runs_here(build):
            known = ", ".join(kernels.SPECS["paged_attention"].builds)
            raise ValueError(f"--attention-builds: {build!r} does not run here (builds: {known})")
    eng = _engine(args, max(batches))  # one model load; each batch's requests aborted after
    rows = [row for b in batches for row in measure(args, eng, b, builds)]
    need = 1 + args.accepted
    print(f"k={args.k} context={args.context} threads={args.threads}: verify pays while "
          f"verify/plain < {need:.2f}")  # fmt: skip
    print(f"{'batch':>6} {'plain ms':>9} {'verify ms':>10} {'ratio':>6}")
    for r in rows:
        build = f"  attention {r['attention_build']}" if "attention_build" in r else ""
        print(
            f"{r['batch']:>6} {r['plain_ms']:>9.2f} {r['verify_ms']:>10.2f} {r['ratio']:>6.2f}"
            + build
        )
        for kind, ms in r.get("parts_ms", {}).items():
            print(
                f"{'':>6} {kind} by part (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items())
            )
    first = rows[0].get("attention_build")  # the crossover of the first build named
    over = [r["batch"] for r in rows if r["ratio"] >= need and r.get("attention_build") == first]
    crossover = over[0] if over else None
    print(
        f"crossover: disable_by_batch_size={crossover}"
        if crossover
        else f"no crossover up to batch {rows[-1]['batch']}: raise --batches"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "crossover": crossover}, f, indent=1)
    return 0
