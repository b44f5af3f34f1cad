"""n = 4 from one request vs four separate requests on 1P1D (LocalCluster, in this process):
prompt tokens prefilled on P, KV bytes sent P->D, choices forked on D, wall time; and the
sampler's per-token cost with penalties + logit_bias against plain sampling.

    PYTHONPATH=src python scripts/api_bench.py [--model PATH] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve import SamplingParams
from pdserve.cluster import LocalCluster
from pdserve.engine.sampler import Sampler


def fork_vs_separate(model: str | None, prompt_tokens: int, max_tokens: int, reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    with LocalCluster(model, transport="tcp") as c:
        vocab = 49000
        for mode in ("n=4, one request", "4 requests, seeds s..s+3"):
            walls, prefill, kv, forks = [], [], [], []
            for r in range(reps):
                prompt = torch.randint(3, vocab, (prompt_tokens,), generator=g).tolist()
                before = _snapshot(c)
                t0 = time.perf_counter()
                if mode.startswith("n=4"):
                    p = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=r, n=4)
                    outs = c.generate([prompt], p)
                    assert len(outs[0].outputs) == 4 and outs[0].error is None
                else:
                    futures = [
                        c.submit(
                            [prompt],
                            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=r + i),
                        )[1]
                        for i in range(4)
                    ]  # concurrent, as four clients would send them
                    outs = [o for f in futures for o in f.result()]
                    assert all(o.error is None for o in outs)
                walls.append(time.perf_counter() - t0)
                after = _snapshot(c)
                prefill.append(after["prefill"] - before["prefill"])
                kv.append(after["kv"] - before["kv"])
                forks.append(after["forks"] - before["forks"])
            print(
                f"| {mode} | {statistics.median(prefill):.0f} | {statistics.median(kv) / 1e6:.2f} "
                f"| {statistics.median(forks):.0f} | {statistics.median(walls):.2f} |"
            )


def _snapshot(c: LocalCluster) -> dict[str, int]:
    stats = c.worker_stats()
    pre = sum(s.get("prefill_tokens", 0) for s in stats.values() if s.get("role") == "prefill")
    forks = sum(s.get("forked_choices", 0) for s in stats.values())
    if not pre:  # stats without a role: P is the worker that sent KV
        pre = max(s.get("prefill_tokens", 0) for s in stats.values())
    return {"prefill": pre, "kv": int(c.stats["kv_send_bytes"]), "forks": forks}


def sampler_cost(vocab: int, steps: int) -> None:
    logits = torch.randn(8, vocab)
    hist = [(list(range(500)), list(range(200)))] * 8
    unseeded = SamplingParams(temperature=1.0)
    plain = SamplingParams(temperature=1.0, seed=1)
    heavy = SamplingParams(
        temperature=1.0,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={5: 3.0, 7: -100.0},
    )
    cases = (("unseeded", unseeded), ("seeded", plain), ("seeded + penalties + bias", heavy))
    for name, p in cases * 2:  # twice: the first round warms up
        s = Sampler()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            s.sample(logits, [f"r{i}" for i in range(8)], [p] * 8, hist)
            times.append(time.perf_counter() - t0)
        print(f"| {name} | {statistics.median(times) / 8 * 1e6:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sampler-only", action="store_true")
    args = ap.parse_args()
    if args.sampler_only:
        sampler_cost(49152, 50)
        return
    print("| mode | prompt tokens prefilled on P | KV MB sent P->D | forked on D | wall s |")
    print("|---|---|---|---|---|")
    fork_vs_separate(args.model, args.prompt_tokens, args.max_tokens, args.reps)
    print("\n| sampler (batch 8, vocab 49152, 700-token history) | us per token |")
    print("|---|---|")
    sampler_cost(49152, 50)


if __name__ == "__main__":
    main()
