"""Prefill tokens/s of pdserve (each prefill format) and vLLM's CPU build, interleaved prompt by
prompt: both are loaded at once (vLLM in a child process, its own venv), and each round times one
prompt on every side in a rotating order, so the host's drifting speed (up to 2x within minutes
here) falls on all sides alike; the per-round ratios are what compare. `--warm` runs an untimed
prompt of the same length right before each timed one (the matrix units and caches as in a run
of prompts back to back).

Usage (from the repository root):
  .venv/bin/python docs/benchmarks/models/prefill_interleaved.py M.gguf HF_FOLDER OUT.json \
      [--rounds 8] [--lens 512,2048] [--formats bf16,bf16x3] [--vllm-python .venv-vllm/bin/python]
      [--pause 1.0] [--warm]

Every prompt is fresh random tokens (no prefix cache on either side); 2 threads each side; the
pause between timings (default one second) lets the idle side's OpenMP threads stop spinning.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import os, sys, time, random
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ["VLLM_NO_USAGE_STATS"] = "1"
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=4096, enable_prefix_caching=False)
sp = SamplingParams(max_tokens=1, temperature=0)
rng = random.Random(1)
def run(n):
    p = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)]}
    t = time.perf_counter(); llm.generate([p], sp, use_tqdm=False)
    return time.perf_counter() - t
run(256)
print("READY", flush=True)
for line in sys.stdin:
    print("SECONDS", run(int(line)), flush=True)
"""


def vllm_child(python: str, folder: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [python, "-c", CHILD, folder],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # vLLM's engine core and worker processes: one group to end
    )
    assert child.stdout is not None
    for line in child.stdout:  # vLLM logs to stdout too: wait for our marker
        if line.startswith("READY"):
            return child
    raise RuntimeError(f"vLLM exited before it was ready (code {child.wait()})")


def vllm_prefill(child: subprocess.Popen[str], n: int) -> float:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(f"{n}\n")
    child.stdin.flush()
    for line in child.stdout:
        if line.startswith("SECONDS"):
            return float(line.split()[1])
    raise RuntimeError("vLLM exited mid-run")


def pdserve_engine(model: str, fmt: str, longest: int):  # type: ignore[no-untyped-def]
    from pdserve import LLM

    llm = LLM(
        model,
        threads=2,
        block_size=16,
        num_blocks=longest // 16 + 4,
        enable_prefix_caching=False,
        max_num_seqs=1,
        max_num_batched_tokens=longest,
        quantization="gguf-a16",
        kv_cache_dtype="float16",
        prefill_format=fmt,
    )
    if llm.engine.stats()["prefill_format"] != fmt:
        raise RuntimeError(f"asked for prefill format {fmt}, got {llm.engine.stats()}")
    return llm.engine


def pdserve_prefill(engine, n: int, rng: random.Random) -> float:  # type: ignore[no-untyped-def]
    from pdserve import SamplingParams

    ids = [rng.randrange(100, engine.arch.vocab_size) for _ in range(n)]
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - t
    if engine.has_unfinished_requests():
        raise RuntimeError(f"a {n}-token prompt did not prefill in one step")
    return seconds


def rounds(args: argparse.Namespace, lens: list[int], engines: dict, child) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """{side: {prompt length: seconds of each round}}, every side timed once a round."""
    rng = random.Random(2)
    sides = [*engines, "vllm"]
    for eng in engines.values():  # warm-up, as vLLM's own
        pdserve_prefill(eng, min(256, max(lens)), rng)
    times: dict[str, dict[int, list[float]]] = {s: {n: [] for n in lens} for s in sides}
    for r in range(args.rounds):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        for n in lens:
            for side in order:
                time.sleep(args.pause)
                for _ in range(2 if args.warm else 1):  # the last one is timed
                    s = (
                        vllm_prefill(child, n)
                        if side == "vllm"
                        else pdserve_prefill(engines[side], n, rng)
                    )
                times[side][n].append(s)
        print(f"round {r + 1}: " + ", ".join(
            f"{side} {n}: {n / times[side][n][-1]:.0f} tok/s" for n in lens for side in sides
        ), file=sys.stderr, flush=True)  # fmt: skip
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("hf")
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--lens", default="512,2048")
    ap.add_argument("--formats", default="bf16,bf16x3")
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between timings")
    ap.add_argument(
        "--warm",
        action="store_true",
        help="an untimed prompt of the same length right before each timed one",
    )
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    load = [os.getloadavg()[0]]
    engines = {f: pdserve_engine(args.gguf, f, max(lens)) for f in args.formats.split(",")}
    child = vllm_child(args.vllm_python, args.hf)
    try:
        times = rounds(args, lens, engines, child)
    finally:  # vLLM's engine core and workers too, whatever happened here
        os.killpg(child.pid, signal.SIGKILL)
    load.append(os.getloadavg()[0])
    sides = [*engines, "vllm"]
    summary = {}
    for f in engines:
        for n in lens:
            ratios = [v / p for p, v in zip(times[f][n], times["vllm"][n], strict=True)]
            summary[f"{f}/vllm@{n}"] = {
                "median_ratio": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
                "rounds_above_1": sum(x > 1 for x in ratios),
            }
    tok_s = {s: {n: [n / t for t in times[s][n]] for n in lens} for s in sides}
    out = {
        "command": " ".join(sys.argv),
        "cpu": Path("/proc/cpuinfo").read_text().split("model name")[1].split("\n")[0].strip(" :"),
        "load_average_start_end": load,
        "tokens_per_s": tok_s,
        "ratio_per_round_pdserve_over_vllm": summary,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
