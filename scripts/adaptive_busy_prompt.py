"""A long prompt reaching `pdserve serve --adaptive` while D decodes, against the same prompt
on the idle host, on one server (issue 45): how much of its prefill the hand-over of the cores
costs.

    python scripts/adaptive_busy_prompt.py [--rounds 3] [--prompt-len 2000] [--answer-len 300]
        [--slo-ttft 10] [--slo-tpot 0.1]

Starts `pdserve serve --adaptive --cores 2` with the SLOs given (run it with PYTHONPATH set to
another tree to measure that tree). Each round: request A (a 200-token prompt, 500 tokens)
starts decoding on D; `--lead` seconds later prompt B (`--prompt-len` random words, a token
each) arrives; once both are done and the host idle for 2 s, prompt C of the same length runs
alone. P's prefill of B and of C come from their timelines (`prefill_start` to `prefill_end` on
P0); each round gives the ratio B / C, so that the host's speed, which moves by up to 1.5x
within minutes here, falls out. Prints each round and the medians; --json keeps them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.harness.servers import Server, running_server

WORDS = "alpha beta gamma delta river stone cloud paper green seven market window table orange"
WORDS = WORDS.split()


def server(args: argparse.Namespace) -> Server:
    def command(_: argparse.Namespace, port: int) -> list[str]:
        return [sys.executable, "-m", "pdserve.cli", "serve", "--adaptive", "--cores", "2",
                "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot),
                "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip

    return Server("pdserve", command)


def words(rng: random.Random, n: int) -> str:
    """`n` words drawn at random, a token each for the default model's tokenizer: no two
    prompts share a cached prefix."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def complete(url: str, model: str, prompt: str, max_tokens: int) -> str:
    """Stream one greedy completion to its end; its response id."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    rid = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not rid and line.startswith("data: {"):
                rid = json.loads(line[5:])["id"]
    return rid


def prefill_s(url: str, rid: str) -> float:
    """P's prefill of `rid`, from its timeline."""
    events = httpx.get(f"{url}/v1/requests/{rid}/timeline", timeout=10).json()["events"]
    at = {e["event"]: e["t_ms"] for e in events if e["worker"].startswith("P")}
    return (at["prefill_end"] - at["prefill_start"]) / 1e3


def one_round(url: str, model: str, texts: tuple[str, str, str], args: argparse.Namespace) -> dict:
    a, b, c = texts
    decoding = threading.Thread(target=complete, args=(url, model, a, 500))
    decoding.start()
    time.sleep(args.lead)
    busy = prefill_s(url, complete(url, model, b, args.answer_len))
    decoding.join()
    time.sleep(2.0)
    alone = prefill_s(url, complete(url, model, c, args.answer_len))
    return {"busy_s": busy, "alone_s": alone, "ratio": busy / alone}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--answer-len", type=int, default=300)
    ap.add_argument("--lead", type=float, default=1.5, help="seconds D decodes before B comes")
    ap.add_argument("--slo-ttft", type=float, default=10.0)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    n = args.rounds + 1  # the first round warms the server
    rng = random.Random(0)
    longs = [words(rng, args.prompt_len) for _ in range(2 * n)]
    shorts = [words(rng, 200) for _ in range(n)]
    rounds: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory() as logs,
        running_server(server(args), args, Path(logs) / "serve.log") as url,
    ):
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        for i in range(n):
            r = one_round(url, model, (shorts[i], longs[2 * i], longs[2 * i + 1]), args)
            if i:
                rounds.append(r)
                print(json.dumps({k: round(v, 3) for k, v in r.items()}), flush=True)
    out = {k: statistics.median(r[k] for r in rounds) for k in ("busy_s", "alone_s", "ratio")}
    print(json.dumps({"median": out}))
    if args.json is not None:
        args.json.write_text(json.dumps({"median": out, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
