"""Batch-1 TPOT with and without prompt-lookup speculation, both servers up at once and timed
request by request in turn (issue 47, item 4): this host's speed moves by up to 2x within
minutes, so one phase after the other compares different host states.

    python scripts/spec_interleaved.py [--form colocated|1p1d] [--requests 10] [--rounds 2]
        [--quantization gguf-a8]

Two `pdserve serve` of the same form (colocated: one worker, 2 threads; 1p1d: 1 + 1 threads),
one with `--speculative-config` (the bench's SPEC_CONFIG), the other plain. RAG-small prompts
(~900 tokens, 64-token greedy answers), each sent to both servers one after the other (the order
alternating), one request at a time: TPOT = (last token - first token) / (tokens - 1), tokens
from the stream's usage. Prints each side's TPOT p50, the median of the per-prompt ratios
spec / plain and the accepted drafts per step the spec server reports; --json keeps them all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.compare import SPEC_CONFIG
from pdserve.bench.harness.servers import Server, running_server
from pdserve.engine.loader import load_tokenizer, resolve_model
from pdserve.workloads.rag import RagWorkload

FORMS = {
    "colocated": ["--colocated", "1", "--threads", "2"],
    "1p1d": ["--prefill", "1", "--decode", "1", "--threads", "1"],
}


def server(form: str, spec: bool, quantization: str) -> Server:
    extra = ["--speculative-config", SPEC_CONFIG] if spec else []
    extra += ["--quantization", quantization]

    def command(args: argparse.Namespace, port: int) -> list[str]:
        return [sys.executable, "-m", "pdserve.cli", "serve", *FORMS[form],
                "--host", "127.0.0.1", "--port", str(port), *extra]  # fmt: skip

    return Server("pdserve", command)


def one(url: str, model: str, prompt: str, max_tokens: int) -> float:
    """TPOT (s) of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    first = last = None
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
    if first is None or last is None or tokens < 2:
        raise RuntimeError(f"{url}: no tokens streamed")
    return (last - first) / (tokens - 1)


def accepted_per_step(url: str) -> float | None:
    """Accepted drafts per verify step, from the server's /metrics (all workers)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"pdserve_spec_accepted_tokens": 0.0, "pdserve_spec_steps": 0.0}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in totals:
                totals[name] += sample.value
    steps = totals["pdserve_spec_steps"]
    return totals["pdserve_spec_accepted_tokens"] / steps if steps else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--form", choices=sorted(FORMS), default="colocated")
    ap.add_argument("--requests", type=int, default=10, help="RAG-small prompts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quantization", default="auto", help="both servers' `--quantization`")
    args = ap.parse_args()
    items = list(RagWorkload(args.requests, 900, 64, 0.0, 0, load_tokenizer(resolve_model(None))))
    tpot: dict[str, list[float]] = {"plain": [], "spec": []}
    with tempfile.TemporaryDirectory() as logs, ExitStack() as stack:
        urls = {
            name: stack.enter_context(
                running_server(
                    server(args.form, name == "spec", args.quantization), args, Path(logs) / name
                )
            )
            for name in tpot
        }
        model = httpx.get(f"{urls['plain']}/v1/models", timeout=10).json()["data"][0]["id"]
        for url in urls.values():  # warm both: kernels, caches
            one(url, model, items[0].text or "", 8)
        for rnd in range(args.rounds):
            for i, item in enumerate(items):
                order = list(tpot) if (rnd + i) % 2 == 0 else list(reversed(tpot))
                for name in order:
                    tpot[name].append(one(urls[name], model, item.text or "", item.max_tokens))
        accepted = accepted_per_step(urls["spec"])
    ratios = [s / p for s, p in zip(tpot["spec"], tpot["plain"], strict=True)]
    out: dict[str, Any] = {
        "form": args.form,
        "quantization": args.quantization,
        "tpot_ms_p50": {k: 1000 * statistics.median(v) for k, v in tpot.items()},
        "ratio_spec_plain_p50": statistics.median(ratios),
        "spec_faster_in": sum(r < 1 for r in ratios),
        "pairs": len(ratios),
        "accepted_per_step": accepted,
        "tpot_ms": {k: [round(1000 * x, 2) for x in v] for k, v in tpot.items()},
    }
    print(json.dumps({k: v for k, v in out.items() if k != "tpot_ms"}))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
