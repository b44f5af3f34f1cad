"""n = 4 from one request vs four separate requests on 1P1D (LocalCluster, in this process):
prompt tokens prefilled on P, KV bytes sent P->D, choices forked on D, wall time; the sampler's
per-token cost with penalties + logit_bias against plain sampling; time per output token with
and without a JSON-schema grammar (one engine, side by side); the grammar's P->D hand-off cost
(build a matcher on D and replay k tokens).

    PYTHONPATH=src python scripts/api_bench.py [--model PATH] [--prompt-tokens 512]
    PYTHONPATH=src python scripts/api_bench.py --grammar-only [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

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


GRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string", "maxLength": 16},
                },
                "required": ["name", "age", "city"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}


def grammar_tpot(model: str | None, reps: int) -> None:
    """TPOT with the JSON-schema grammar vs the same number of tokens without, alternating."""
    from pdserve import LLM

    llm = LLM(model)
    prompt = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List two people with name, age and city as JSON."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    guided = SamplingParams(
        max_tokens=96, temperature=0, structured_outputs={"json": GRAMMAR_SCHEMA}
    )
    llm.generate([prompt], guided, use_tqdm=False)  # warm-up: builds the llguidance tokenizer
    tpot: dict[str, list[float]] = {"json schema": [], "none": []}
    tokens = 0
    for _ in range(reps):
        out = llm.generate([prompt], guided, use_tqdm=False)[0]
        tokens = len(out.outputs[0].token_ids)
        finish = out.outputs[0].finish_reason
        if finish == "stop":
            json.loads(out.outputs[0].text)  # it parses, or this run is no measurement
        tpot["json schema"].append(_tpot(out))
        free = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        tpot["none"].append(_tpot(llm.generate([prompt], free, use_tqdm=False)[0]))
        print(
            f"  run: {tokens} tokens ({finish}), {tpot['json schema'][-1] * 1e3:.1f} vs "
            f"{tpot['none'][-1] * 1e3:.1f} ms",
            flush=True,
        )
    for name, values in tpot.items():
        print(
            f"| {name} | {tokens} | {statistics.median(values) * 1e3:.2f} | "
            f"{' '.join(f'{v * 1e3:.1f}' for v in values)} |"
        )
    ratio = statistics.median(tpot["json schema"]) / statistics.median(tpot["none"])
    print(f"\nratio of medians (json schema / none): {ratio:.3f}")


def _tpot(out: Any) -> float:
    m = out.metrics
    return (m.finished_time - m.first_token_time) / max(1, len(out.outputs[0].token_ids) - 1)


def handoff_cost(model: str | None, reps: int = 50) -> None:
    """D's side of the grammar hand-off: build a matcher and replay the k tokens P sampled."""
    from pdserve.engine import loader
    from pdserve.engine.grammar import GrammarBackend

    tokenizer = loader.load_tokenizer(loader.resolve_model(model))
    backend = GrammarBackend(tokenizer, len(tokenizer))
    spec = {"json": GRAMMAR_SCHEMA}
    doc = '{"people":[{"name":"Ann","age":31,"city":"Oslo"},{"name":"Bo","age":4,"city":"Rome"}'
    ids = tokenizer.encode(doc, add_special_tokens=False)
    backend.matcher(spec)  # warm-up
    for k in (0, 1, 4):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            backend.matcher(spec).replay(ids[:k])
            times.append(time.perf_counter() - t0)
        print(f"| {k} | {statistics.median(times) * 1e6:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sampler-only", action="store_true")
    ap.add_argument("--grammar-only", action="store_true")
    args = ap.parse_args()
    if args.grammar_only:
        print("| grammar | output tokens | TPOT ms (median) | TPOT ms, each run |")
        print("|---|---|---|---|")
        grammar_tpot(args.model, args.reps)
        print("\n| hand-off tokens replayed on D | build matcher + replay, us (median) |")
        print("|---|---|")
        handoff_cost(args.model)
        return
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
