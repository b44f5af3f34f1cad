"""TTFT of conversations' later turns with D's KV reused, against prefilling them on P (issue 47,
item 4): the same seeded conversations against `pdserve serve` (1P1D, the default model) twice.

    python scripts/multiturn_reuse.py [--conversations 12] [--json out.json]

`reuse`: the defaults (a finished turn's KV kept on D for --conversation-ttl, a follow-up with
at most --conversation-local-tokens new tokens prefilled on that D; no planner, or with
--planner the SLO planner's choice). `on-p`: --conversation-ttl 0
--conversation-local-tokens 0, so every turn is prefilled on P (P's and D's prefix caches work
as they do for any request: P still finds earlier prompts, not the answers). Conversations of 3
to 5 turns (seeded), a RAG-sized opening (--first-len tokens), short follow-ups, exponential
think time between turns, two conversations at a time. Prints TTFT p50 of turn 1 and of turns
2+ for both runs and the reduction of turns 2+ (the issue's target: at least 50%). Run it on a
quiet machine: the two runs are timed one after the other.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from pdserve.bench.harness.servers import Server, run_load, running_server
from pdserve.workloads.spec import LoadSpec

RUNS = {
    "reuse": [],
    "on-p": ["--conversation-ttl", "0", "--conversation-local-tokens", "0"],
}
# --planner: the SLO planner decides local vs P (this host's cost model, profiled when none is
# saved); the on-p run then needs --disaggregation always to keep every turn on P
PLANNER = {"reuse": ["--cost-model", "auto", "--disaggregation", "conditional"],
           "on-p": ["--cost-model", "auto", "--disaggregation", "always"]}  # fmt: skip


def serve_command(extra: list[str], threads: int) -> Server:
    def command(args: argparse.Namespace, port: int) -> list[str]:
        return [sys.executable, "-m", "pdserve.cli", "serve", "--prefill", "1", "--decode", "1",
                "--threads", str(threads), "--port", str(port), *extra]  # fmt: skip

    return Server("pdserve", command)


def one_run(name: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    planner = PLANNER[name] if args.planner else ["--cost-model", "none"]
    server = serve_command([*RUNS[name], *planner], args.threads)
    with running_server(server, args, logs / f"{name}.log") as url:
        spec = LoadSpec(
            url=url,
            num_requests=args.conversations * 4,  # 3 to 5 turns: about this many conversations
            concurrency=2,
            workload="multiturn",
            input_len=args.follow_len,
            output_len=args.output_len,
            len_spread=0.2,
            seed=args.seed,
            think_time=args.think_time,
            workload_args={"turns_range": (3, 5), "first_len": args.first_len},
            no_progress=True,
        )
        return run_load(spec)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--first-len", type=int, default=1500, help="opening question, tokens")
    ap.add_argument("--follow-len", type=int, default=48, help="later questions, tokens")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--think-time", type=float, default=1.0, help="mean seconds (exponential)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--planner", action="store_true", help="route by the SLO planner")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as logs:
        for name in RUNS:
            results[name] = one_run(name, args, Path(logs))
    rows = []
    for name, res in results.items():
        phases = res["by_phase"]
        turns = ("turn 1", "turns 2+")
        p50 = {ph: phases.get(ph, {}).get("ttft_ms", {}).get("p50") for ph in turns}
        rows.append((name, p50["turn 1"], p50["turns 2+"], res["completed"], res["failed"]))
    print("| run | TTFT p50 turn 1 (ms) | TTFT p50 turns 2+ (ms) | completed | failed |")
    print("|---|---|---|---|---|")
    for name, first, later, done, failed in rows:
        print(f"| {name} | {_ms(first)} | {_ms(later)} | {done} | {failed} |")
    reuse, on_p = rows[0][2], rows[1][2]
    if reuse and on_p:
        print(f"\nturns 2+ TTFT p50: {100 * (1 - reuse / on_p):.0f}% lower with reuse")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
