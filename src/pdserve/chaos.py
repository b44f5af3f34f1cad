"""`pdserve chaos`: drive load through a LocalCluster while killing, stalling and restarting its
workers at random; then count what was lost.

    pdserve chaos [MODEL] --prefill 2 --decode 2 --duration 600 --fault-every 5

Load: `--concurrency` threads, each sending one greedy request at a time: a prompt from a fixed
set (short to a few hundred tokens) and a length between a quarter of `--max-tokens` and all of
it; the fault-free outputs are measured first, on the same cluster (a shorter request's tokens
are a prefix of the full one's). Faults: every
`--fault-every` seconds one worker that is up is killed (SIGKILL, restarted on the same
addresses `--down` seconds later) or stalled (SIGSTOP, resumed after `--down` s); one at a time,
so with two workers of each role a healthy pair always exists.

Report (printed, and as JSON with `--output`):
  * lost: requests that neither completed nor got an error (a hang or an exception): must be 0;
  * errors: requests answered with an error (expected 0 with >= 2 workers of each role);
  * wrong: completed requests whose tokens differ from the fault-free output: must be 0;
  * leaked_blocks: KV blocks still used on any worker after the load stops and the cluster
    idles: must be 0;
  * recovery_ms: per recovered request, from the router's worker_down event to the next first
    token of the new attempt (p50, p99), and the router's counters;
  * rss: resident memory of the router process and of every worker that lived through the run,
    after a warm-up round and at the end (`--faults none` makes this a soak run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.cluster import LocalCluster
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import SamplingParams
from pdserve.percentiles import percentiles
from pdserve.router import timeline as tl

PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):",
    "Water boils at",
    "In a distant galaxy, a small robot",
    "The three laws of thermodynamics are",
    "Once upon a time",
    # a long one: several KV blocks and frames per hand-off
    " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
    + " Summarize the items above.",
)


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    wrong: int = 0
    lost: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    recovery_ms: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, out: RequestOutput | None, want: list[int], failure: str | None) -> None:
        with self.lock:
            self.sent += 1
            if out is None:
                self.lost += 1
                self.errors[f"lost: {failure}"] += 1
            elif out.error is not None:
                self.errors[out.error[:120]] += 1
            else:
                self.completed += 1
                self.wrong += out.outputs[0].token_ids != want
                self.recovery_ms += recovery_times(out.timeline or [])


def recovery_times(timeline: list[tuple[str, str, float]]) -> list[float]:
    """Per worker_down event: ms until the next first token of a new attempt."""
    out, down_at = [], None
    for event, _, t in timeline:
        if tl.kind_of(event) == tl.Ev.WORKER_DOWN:
            down_at = down_at if down_at is not None else t
        elif event == tl.Ev.FIRST_TOKEN and down_at is not None:
            out.append((t - down_at) * 1e3)
            down_at = None
    return out


def _load(
    cluster: LocalCluster,
    wants: dict[str, list[int]],
    params: SamplingParams,
    stop: threading.Event,
    tally: Tally,
    seed: int,
    timeout_s: float,
) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        prompt = rng.choice(PROMPTS)
        n = rng.randint(max(1, params.max_tokens // 4), params.max_tokens)
        one = dataclasses.replace(params, max_tokens=n)
        try:
            (out,) = cluster.generate([prompt], one, timeout_s=timeout_s)
            tally.record(out, wants[prompt][:n], None)
        except Exception as e:  # a timeout here is a lost request: the thing that must not be
            tally.record(None, wants[prompt][:n], f"{type(e).__name__}: {e}")


def rss_mb(pid: int) -> float | None:
    """Resident memory of a process, MiB (Linux /proc), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _memory(cluster: LocalCluster) -> dict[str, tuple[int, float | None]]:
    """(pid, RSS MiB) of every worker process and of this one (the router core)."""
    out = {"router": (os.getpid(), rss_mb(os.getpid()))}
    for w in cluster.workers:
        if w.launched.proc is not None:
            out[w.worker_id] = (w.launched.proc.pid, rss_mb(w.launched.proc.pid))
    return out


def _growth(
    before: dict[str, tuple[int, float | None]], after: dict[str, tuple[int, float | None]]
) -> dict[str, Any]:
    """RSS growth per process that lived through the whole run (same pid before and after)."""
    rows = {}
    for name, (pid, start) in before.items():
        end_pid, end = after.get(name, (None, None))
        if end_pid == pid and start and end:
            rows[name] = {"start_mb": round(start, 1), "end_mb": round(end, 1),
                          "growth_pct": round(100 * (end - start) / start, 2)}  # fmt: skip
    return rows


def _inject(cluster: LocalCluster, rng: random.Random, kinds: list[str], down_s: float) -> str:
    up = [w.worker_id for w in cluster.workers if w.state == "up"]
    victim, kind = rng.choice(up), rng.choice(kinds)
    if kind == "kill":
        cluster.kill(victim)
        time.sleep(down_s)
        cluster.restart(victim)
    else:
        cluster.stall(victim)
        time.sleep(down_s)
        cluster.resume(victim)
    return f"{kind} {victim}"


def run_chaos(cluster: LocalCluster, args: argparse.Namespace) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    outs = cluster.generate(list(PROMPTS), params, timeout_s=120)  # fault-free reference
    wants = {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs, strict=True)}
    # warm (a first round of every prompt done): memory from here on should stay flat
    cluster.generate(list(PROMPTS) * args.concurrency, params, timeout_s=300)
    memory_before = _memory(cluster)
    tally, stop = Tally(), threading.Event()
    threads = [
        threading.Thread(
            target=_load,
            args=(cluster, wants, params, stop, tally, args.seed + i, args.request_timeout),
            daemon=True,
        )
        for i in range(args.concurrency)
    ]
    for t in threads:
        t.start()
    rng, faults = random.Random(args.seed), []
    t_end = time.monotonic() + args.duration
    while args.faults and time.monotonic() + args.fault_every < t_end:
        time.sleep(args.fault_every)
        faults.append(_inject(cluster, rng, args.faults, args.down))
    time.sleep(max(0.0, t_end - time.monotonic()))
    stop.set()
    for t in threads:
        t.join(timeout=args.request_timeout + 10)
    idle = cluster.wait_idle(timeout_s=30)
    report = _report(cluster, tally, faults, idle, args)
    report["rss"] = _growth(memory_before, _memory(cluster))
    return report


def _report(
    cluster: LocalCluster,
    tally: Tally,
    faults: list[str],
    idle: dict[str, dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    rec = tally.recovery_ms
    counters = dict(cluster.stats)
    return {
        "duration_s": args.duration,
        "workers": {"prefill": args.prefill, "decode": args.decode},
        "faults": faults,
        "requests": tally.sent,
        "completed": tally.completed,
        "errors": dict(tally.errors),
        "lost": tally.lost,
        "wrong": tally.wrong,
        "leaked_blocks": sum(int(s["kv_blocks_used"]) for s in idle.values()),
        "workers_not_idle": [w for w, s in idle.items() if s["running"] or s["waiting"]],
        "recovery_ms": {"n": len(rec), **percentiles(rec, (50, 99))} if rec else None,
        "router": {k: counters.get(k, 0) for k in (
            "workers_down", "workers_up", "recoveries", "local_fallbacks", "retries",
            "send_dropped")},
    }  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="HF folder or .gguf")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--fault-every", type=float, default=5.0, help="seconds between faults")
    parser.add_argument("--down", type=float, default=2.0, help="seconds a victim stays down")
    parser.add_argument(
        "--faults", default="kill,stall", help="kinds: kill, stall; none: a soak run (no faults)"
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write the report as JSON")


def run(args: argparse.Namespace) -> int:
    kinds = [k.strip() for k in str(args.faults).split(",") if k.strip()]
    args.faults = [] if kinds == ["none"] else kinds
    if set(args.faults) - {"kill", "stall"}:
        raise ValueError("--faults takes kill and/or stall, or none (a soak run)")
    with LocalCluster(args.model, prefill=args.prefill, decode=args.decode, transport="tcp",
                      threads=args.threads) as cluster:  # fmt: skip
        report = run_chaos(cluster, args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    ok = report["lost"] == 0 and report["wrong"] == 0 and report["leaked_blocks"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="pdserve chaos", description=__doc__)
    add_arguments(p)
    sys.exit(run(p.parse_args()))
