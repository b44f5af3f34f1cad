"""Start-up to first token of `pdserve serve` (default model, 1 P + 1 D, one thread each), for
one or more source trees alternated round by round.

    python scripts/startup_bench.py [--rounds 4] SRC [SRC ...]

Each SRC is a checkout's `src/` folder (e.g. a `git worktree` of an older commit): the server
runs with PYTHONPATH=SRC, so the same virtualenv serves every tree. Each tree gets its own empty
cache directory ($PDSERVE_CACHE_DIR) for the whole run: its first round starts with nothing
cached (a first start on a machine), later rounds find what the first one kept (every later
start, and a worker restarted after a crash). Per round: seconds from the command to the
"serving" line, and to the answer of a 1-token completion. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from pdserve.hostinfo import cpu_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_to_first_token(src: str, cache: str) -> tuple[float, float]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": src, "PYTHONUNBUFFERED": "1", "PDSERVE_CACHE_DIR": cache}
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--threads", "1"]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        while "serving" not in proc.stdout.readline():
            if proc.poll() is not None:
                raise SystemExit(f"pdserve serve from {src} exited {proc.returncode}")
        ready = time.monotonic() - t0
        url = f"http://127.0.0.1:{port}/v1"
        model = httpx.get(f"{url}/models", timeout=60).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 1}
        httpx.post(f"{url}/completions", json=body, timeout=120).raise_for_status()
        return ready, time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("srcs", nargs="+", help="source trees (a checkout's src/ folder)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    caches = {src: tempfile.mkdtemp(prefix="pdserve-startup-") for src in args.srcs}
    runs: dict[str, list[tuple[float, float]]] = {src: [] for src in args.srcs}
    for r in range(args.rounds):
        for src in args.srcs:
            runs[src].append(start_to_first_token(src, caches[src]))
            ready, first = runs[src][-1]
            print(f"round {r} {src}: serving {ready:.1f} s, first token {first:.1f} s", flush=True)
    print(f"\nCPU: {cpu_model()}, {os.cpu_count()} cores; {args.rounds} rounds, trees alternated\n")
    print("| tree | first start, nothing cached (s) | later starts (s) | median of later (s) |")
    print("|---|---:|---|---:|")
    for src, got in runs.items():
        later = [f for _, f in got[1:]]
        each = ", ".join(f"{f:.1f}" for f in later)
        med = f"{statistics.median(later):.1f}" if later else "-"
        print(f"| {src} | {got[0][1]:.1f} | {each} | {med} |")


if __name__ == "__main__":
    main()
