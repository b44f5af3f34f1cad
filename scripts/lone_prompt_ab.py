"""A lone long prompt's prefill on several `pdserve serve` forms started side by side, paired
round by round (issue 45): what a form's own machinery costs one prompt on an idle host.

    python scripts/lone_prompt_ab.py [--rounds 6] [--prompt-len 2000] [--answer-len 4] \
        [--json OUT] NAME='FLAGS' NAME='FLAGS' ...

Each NAME='FLAGS' is one server (`pdserve serve FLAGS`); a leading `PYTHONPATH=DIR` in FLAGS
runs that server from another tree, so a change and its parent run in one window. All servers
start first (an idle server sleeps in its poll: it takes no core from the others); then each
round sends one prompt of `--prompt-len` random words (a token each, no shared prefix) to each
server in turn, alone on the host, reversing the order every round, and reads its prefill
(`prefill_start` to `prefill_end` on the worker that prefilled it) from the timeline. The first
round warms up and is not counted. Per round, each server's time over the first server's takes
out the host's speed, which moves by up to 1.5x within minutes here; the medians of both are
printed, and --json keeps every round.

    python scripts/lone_prompt_ab.py colocated='--colocated 1 --threads 2' \
        adaptive='--adaptive --cores 2 --slo-ttft 10 --slo-tpot 0.1'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.harness.servers import Server, running_server

WORDS = "alpha beta gamma delta river stone cloud paper green seven market window table orange"
WORDS = WORDS.split()


def server(flags: str) -> Server:
    words = flags.split()
    env = [w for w in words if w.startswith("PYTHONPATH=")]
    rest = [w for w in words if not w.startswith("PYTHONPATH=")]

    def command(_: argparse.Namespace, port: int) -> list[str]:
        return ["env", *env, sys.executable, "-m", "pdserve.cli", "serve", *rest,
                "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip

    return Server("pdserve", command)


def prefill_s(url: str, model: str, prompt: str, answer_len: int) -> float:
    """Complete `prompt`; its prefill from the timeline (the worker that prefilled it)."""
    body = {"model": model, "prompt": prompt, "max_tokens": answer_len, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    events = httpx.get(f"{url}/v1/requests/{r.json()['id']}/timeline", timeout=10).json()["events"]
    at = {e["event"]: e["t_ms"] for e in events if e["event"] in ("prefill_start", "prefill_end")}
    return (at["prefill_end"] - at["prefill_start"]) / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("servers", nargs="+", metavar="NAME=FLAGS")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--answer-len", type=int, default=4)
    ap.add_argument("--gap", type=float, default=1.5, help="idle seconds before each prompt")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--log-dir", type=Path, default=Path("."))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    forms = dict(s.split("=", 1) for s in args.servers)
    names = list(forms)
    rng = random.Random(1)
    times: dict[str, list[float]] = {n: [] for n in names}
    with contextlib.ExitStack() as stack:
        urls = {
            n: stack.enter_context(running_server(server(f), args, args.log_dir / f"{n}.log"))
            for n, f in forms.items()
        }
        model = httpx.get(f"{urls[names[0]]}/v1/models", timeout=10).json()["data"][0]["id"]
        for r in range(args.rounds + 1):
            for n in names if r % 2 == 0 else names[::-1]:
                time.sleep(args.gap)
                prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_len))
                s = prefill_s(urls[n], model, prompt, args.answer_len)
                if r:
                    times[n].append(s)
                print(json.dumps({"round": r, "server": n, "prefill_s": round(s, 3)}), flush=True)
    base = times[names[0]]
    out: dict[str, Any] = {"flags": forms, "rounds": times, "median_s": {}, "median_ratio": {}}
    for n in names:
        out["median_s"][n] = statistics.median(times[n])
        ratios = [t / b for t, b in zip(times[n], base, strict=True)]
        out["median_ratio"][n] = statistics.median(ratios)
    print(json.dumps({k: out[k] for k in ("median_s", "median_ratio")}))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
