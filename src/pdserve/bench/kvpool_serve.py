"""`pdserve bench kvpool-serve`: the KV pool's users, end to end, pool on vs off.

Prefix reuse: two separate `pdserve serve` instances (1 P + 1 D each), sharing one KV pool (a
redis-server this command starts on a free loopback port, or `--pool disk`: a shared folder).
Conversations with a shared system prompt take turns; turn t of conversation c goes to instance
(c + t) % 2, so every later turn lands where its history was *not* computed: only the pool can
spare its prefill. Requests run one at a time; per turn: client TTFT p50/p90 and the prompt
tokens the workers computed (`/admin/kvpool` prefill_tokens). Then the same without the pool.

Recovery: one instance (1 P + 2 D); a request with a `--recovery-prompt`-token prompt streams
until `--recovery-kill-at` tokens were generated, then the D serving it is SIGKILLed. Measured:
kill to the next token at the client, and the prompt tokens computed again (the workers'
prefill_tokens beyond the first prefill; with the pool also the `recovered_from_pool` entry of
the request's timeline).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.harness.report import (
    ReportHead,
    invoked_as,
    machine_info,
    write_json,
    write_report,
)
from pdserve.bench.harness.servers import Server, redis_server, running_server
from pdserve.percentiles import percentile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder or .gguf; default: SmolLM2-135M")
    parser.add_argument("--pool", choices=("redis", "disk"), default="redis")
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--user-tokens", type=int, default=40, help="new tokens per turn")
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--recovery-prompt", type=int, default=1000)
    parser.add_argument("--recovery-kill-at", type=int, default=500, help="generated tokens")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--skip-turns", action="store_true")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument(
        "--kv-cache-memory-gb", type=float, default=0.5, help="each worker's KV cache"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="markdown report")
    parser.add_argument("--json", type=Path, default=None, help="raw results")
    parser.add_argument("--logs", type=Path, default=Path("kvpool-serve-logs"))


# ---- servers -------------------------------------------------------------------------------------
def _server(name: str, argv: list[str]) -> Server:
    """`pdserve serve` with `argv` on the port the harness picks."""
    return Server(
        name,
        lambda _, port: [sys.executable, "-m", "pdserve.cli", "serve", *argv, "--port", str(port)],
    )


def _serve_argv(args: argparse.Namespace, decode: int, pool: list[str]) -> list[str]:
    model = [args.model] if args.model else []
    return [*model, "--prefill", "1", "--decode", str(decode), "--threads", "1",
            "--cost-model", "none", "--no-restart-workers",
            "--kv-cache-memory-gb", str(args.kv_cache_memory_gb), *pool]  # fmt: skip


@contextlib.contextmanager
def pool_flags(kind: str) -> Iterator[list[str]]:
    if kind == "redis":
        if shutil.which("redis-server") is None:
            raise SystemExit("redis-server is not installed (make redis); or use --pool disk")
        with redis_server() as url:
            yield ["--kv-pool-redis", url]
    else:
        folder = tempfile.mkdtemp(prefix="pdserve-bench-pool-")
        try:
            yield ["--kv-pool-disk", folder]
        finally:
            shutil.rmtree(folder, ignore_errors=True)


# ---- one streamed request ------------------------------------------------------------------------
@dataclass
class Streamed:
    rid: str = ""
    text: str = ""
    tokens: int = 0
    ttft_s: float = 0.0
    stamps: list[float] = field(default_factory=list)  # time.monotonic() of each chunk


def stream(url: str, prompt: list[int], max_tokens: int, on_chunk: Any = None) -> Streamed:
    body = {"model": _model_id(url), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    out = Streamed()
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            obj = json.loads(line[5:])
            out.rid = out.rid or obj.get("id", "")
            text = (obj.get("choices") or [{}])[0].get("text") or ""
            if not text:
                continue
            now = time.monotonic()
            out.ttft_s = out.ttft_s or now - t0
            out.stamps.append(now)
            out.text += text
            out.tokens += 1
            if on_chunk is not None:
                on_chunk(out)
    return out


_MODEL_IDS: dict[str, str] = {}


def _model_id(url: str) -> str:
    if url not in _MODEL_IDS:
        _MODEL_IDS[url] = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    return _MODEL_IDS[url]


def computed(url: str) -> int:
    """Prompt tokens every worker of this server computed so far (stats are polled each 1 s)."""
    time.sleep(1.5)
    report = httpx.get(f"{url}/admin/kvpool", timeout=10).json()
    return int(sum(report.get("prefill_tokens", {}).values()))


def tokenizer(model: str | None) -> Any:
    from pdserve.engine import loader

    return loader.load_tokenizer(loader.resolve_model(model))


def _ids(gen: Any, n: int, vocab: int) -> list[int]:
    return [int(t) for t in gen.integers(100, vocab - 100, n)]


# ---- prefix reuse over two instances -------------------------------------------------------------
def run_turns(args: argparse.Namespace, pool: list[str], label: str) -> dict[str, Any]:
    import numpy as np

    tok = tokenizer(args.model)
    vocab = min(int(tok.vocab_size), 49000)
    gen = np.random.default_rng(args.seed)
    system = _ids(gen, args.system_tokens, vocab)
    history = [list(system) for _ in range(args.conversations)]
    servers = [_server(f"{label}-{i}", _serve_argv(args, 1, pool)) for i in range(2)]
    turns: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(running_server(s, args, args.logs / f"{s.name}.log"))
            for s in servers
        ]
        for t in range(args.turns):
            before = [computed(u) for u in urls]
            ttfts, prompt_tokens = [], 0
            for c in range(args.conversations):
                prompt = history[c] + _ids(gen, args.user_tokens, vocab)
                got = stream(urls[(c + t) % 2], prompt, args.answer_tokens)
                ttfts.append(got.ttft_s)
                prompt_tokens += len(prompt)
                history[c] = prompt + list(tok.encode(got.text, add_special_tokens=False))
            after = [computed(u) for u in urls]
            turns.append({
                "turn": t, "ttft_s": ttfts, "prompt_tokens": prompt_tokens,
                "computed_tokens": sum(after) - sum(before),
            })  # fmt: skip
            print(f"{label} turn {t}: ttft p50 {statistics.median(ttfts):.3f}s, computed "
                  f"{turns[-1]['computed_tokens']}/{prompt_tokens}", flush=True)  # fmt: skip
    return {"label": label, "turns": turns}


# ---- recovery ------------------------------------------------------------------------------------
def _decode_pid(url: str, rid: str) -> int:
    events = httpx.get(f"{url}/v1/requests/{rid}/timeline", timeout=10).json()["events"]
    # the last route: a spurious recovery earlier (a heartbeat missed on a loaded machine) may
    # have moved the request already
    route = [e["worker"] for e in events if e["event"].startswith("route")][-1]
    dec = route.split("->")[-1]  # "P0->D0", or "D1" (a D resuming from the pool)
    workers = httpx.get(f"{url}/admin/workers", timeout=10).json()
    return int(next(w["pid"] for w in workers if w["id"] == dec))


def run_recovery(args: argparse.Namespace, pool: list[str], label: str) -> dict[str, Any]:
    import numpy as np

    tok = tokenizer(args.model)
    gen = np.random.default_rng(args.seed + 1)
    prompt = _ids(gen, args.recovery_prompt, min(int(tok.vocab_size), 49000))
    server = _server(f"{label}-recovery", _serve_argv(args, 2, pool))
    killed: dict[str, float] = {}

    def maybe_kill(s: Streamed) -> None:
        if not killed and s.tokens >= args.recovery_kill_at:
            pid = _decode_pid(url, s.rid)
            killed["at"] = time.monotonic()
            os.kill(pid, signal.SIGKILL)

    with running_server(server, args, args.logs / f"{server.name}.log") as url:
        before = computed(url)
        total = args.recovery_kill_at + 64
        got = stream(url, prompt, total, maybe_kill)
        after = computed(url)
        events = httpx.get(f"{url}/v1/requests/{got.rid}/timeline", timeout=10).json()["events"]
    # Chunks the router had already sent arrive right after the kill; the recovery is the
    # longest silence after it: its end is the first token of the new attempt.
    later = [killed["at"], *(t for t in got.stamps if t > killed["at"])]
    gaps = [(b - a, b) for a, b in itertools.pairwise(later)]
    next_token = max(gaps)[1] if gaps else killed["at"]
    recovered = [e["event"] for e in events if e["event"].startswith("recovered_from_pool")]
    downs = [
        f"{e['event']} ({e['worker']})" for e in events if e["event"].startswith("worker_down")
    ]
    return {
        "label": label,
        "context_at_kill": len(prompt) + args.recovery_kill_at,
        "kill_to_next_token_s": next_token - killed["at"],
        "recomputed_tokens": after - before - len(prompt),
        "tokens": got.tokens,
        "complete": got.tokens == total,
        "recovered_from_pool": recovered,
        "worker_down": downs,  # more than one: the machine missed heartbeats besides the kill
    }


# ---- report --------------------------------------------------------------------------------------
def render(head: ReportHead, data: dict[str, Any]) -> str:
    m = head.machine
    lines = [
        f"Measured {head.date} with `{head.command}`; CPU {m['cpu']}, {m['cores']} cores, "
        f"load average {m['load_average']}.",
        "",
    ]
    if data.get("turns"):
        on, off = data["turns"]["on"], data["turns"]["off"]
        lines += [
            "| turn | TTFT p50 off | p50 on | p90 off | p90 on | computed off | on | "
            "prompt tokens | p50 on/off |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for a, b in zip(off["turns"], on["turns"], strict=True):
            p50a, p50b = statistics.median(a["ttft_s"]), statistics.median(b["ttft_s"])
            lines.append(
                f"| {a['turn']} | {p50a * 1e3:.0f} ms | {p50b * 1e3:.0f} ms | "
                f"{percentile(a['ttft_s'], 90) * 1e3:.0f} ms | "
                f"{percentile(b['ttft_s'], 90) * 1e3:.0f} ms | "
                f"{a['computed_tokens']} | {b['computed_tokens']} | {a['prompt_tokens']} | "
                f"{p50b / p50a:.2f} |"
            )
        later_off = [x for t in off["turns"][1:] for x in t["ttft_s"]]
        later_on = [x for t in on["turns"][1:] for x in t["ttft_s"]]
        if later_off and later_on:
            ratio = statistics.median(later_on) / statistics.median(later_off)
            verdict = "met" if ratio <= 0.5 else "missed"
            lines += ["", f"Later turns (1+): TTFT p50 {statistics.median(later_off) * 1e3:.0f} ms "
                      f"off, {statistics.median(later_on) * 1e3:.0f} ms on: **{ratio:.2f}x** "
                      f"(target <= 0.5x: {verdict})."]  # fmt: skip
    if data.get("recovery"):
        lines += ["", "| recovery | context at kill | kill -> next token | prompt tokens "
                  "recomputed | complete | timeline |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in (data["recovery"]["off"], data["recovery"]["on"]):
            lines.append(
                f"| pool {r['label']} | {r['context_at_kill']} | "
                f"{r['kill_to_next_token_s']:.2f} s | {r['recomputed_tokens']} | "
                f"{r['complete']} | {'; '.join(r['worker_down'] + r['recovered_from_pool'])} |"
            )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    data: dict[str, Any] = {"pool": args.pool}
    if not args.skip_turns:
        data["turns"] = {"off": run_turns(args, [], "off")}
        with pool_flags(args.pool) as flags:
            data["turns"]["on"] = run_turns(args, flags, "on")
    if not args.skip_recovery:
        data["recovery"] = {"off": run_recovery(args, [], "off")}
        with pool_flags(args.pool) as flags:
            data["recovery"]["on"] = run_recovery(args, flags, "on")
    command = invoked_as("kvpool-serve") or "pdserve bench kvpool-serve"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = ReportHead(date, command, machine_info(1, pool=args.pool))
    data["head"] = vars(head)
    markdown = render(head, data)
    if args.output is not None:
        write_report(markdown, data, args.output, args.json)
    else:
        print(markdown)
        if args.json:
            write_json(args.json, data)
    return 0
