"""bf16x3's AMX causal attention for a prompt chunk over a cached prefix, per layer, one thread:
the default model's heads (9 query heads on 3 KV heads, head_dim 64), random float32 q, k, v.

    PYTHONPATH=TREE/src python docs/benchmarks/prefill/amx_attention_chunks.py [--reps 20]

Run it from two trees in turn (each builds its own kernel: PDSERVE_KERNEL_CACHE apart) to compare
kernels side by side; it prints one JSON line: {"n/ctx": ms a call}.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pdserve.engine import kernels

SHAPES = [(16, 1816), (48, 1848), (110, 1910), (512, 512), (2000, 2000)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    amx = kernels.load("amx")
    g = torch.Generator().manual_seed(0)
    out = {}
    for n, ctx in SHAPES:
        q = torch.randn(n, 9, 64, generator=g)
        k, v = torch.randn(ctx, 3, 64, generator=g), torch.randn(ctx, 3, 64, generator=g)
        amx.causal_attention(q, k, v, 0.125)  # warm
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            amx.causal_attention(q, k, v, 0.125)
            times.append(time.perf_counter() - t)
        out[f"{n}/{ctx}"] = round(1000 * sorted(times)[len(times) // 2], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
