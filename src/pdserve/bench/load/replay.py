"""`pdserve bench replay TRACE --url URL`: a production trace's window, replayed against a server.

The trace (Mooncake jsonl or Azure csv: workloads/traces.py) is windowed (`--start-ms`,
`--limit`) and scaled (`--length-scale`: prompt, block and output lengths; `--time-scale`:
arrival times), and each request is sent at its own arrival time, streamed, with `max_tokens` =
its scaled output length and EOS ignored (so the output length is the trace's). Prompts repeat
exactly where the trace's hash_ids repeat: each id is a fixed, seeded block of text (one token
per word under the served model's tokenizer: bench/load/trace_text.py; checked against the
server's own count before the run), or of token ids with `--prompt-format ids`. A request that
does not fit the model's context (its `max_model_len`, from /v1/models) is cut: the output to at
most half the context, then the prompt's tail (the count is in the report).

It reports what `bench serve` reports (bench/load/summary.py: TTFT, TPOT, ITL, E2E percentiles,
goodput under `--slo-ttft`/`--slo-tpot`, failures) plus the prefix reuse:
  * `prefix_hit_ratio`: what the trace promises (traces.expected_prefix_hits: prompt tokens of
    blocks seen earlier in the window / all prompt tokens, an unbounded cache);
  * `server_prefix_hit_ratio`: what the server measured, from its /metrics before and after the
    run: 1 - prompt tokens its workers computed / prompt tokens sent to them (a pdserve
    server; None elsewhere), and its KV pool's hit / looked-up blocks when it has a pool.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve import argtypes
from pdserve.bench.harness.report import write_json
from pdserve.bench.load.client import (
    BACKENDS,
    auth_headers,
    completion_body,
    fetch_model,
    send_request,
)
from pdserve.bench.load.summary import RequestRecord, format_table, summarize
from pdserve.bench.load.trace_text import BlockText, server_block_tokens
from pdserve.workloads import traces
from pdserve.workloads.spec import LoadSpec

SETTLE_S = 2.5  # workers' stats reach the router's /metrics every second: wait for the last
COUNTERS = {  # /metrics sample -> what the report calls it, summed over workers and tiers
    "pdserve_prompt_tokens_total": "prompt_tokens",
    "pdserve_worker_prefill_tokens_total": "prefill_tokens",
    "pdserve_kvpool_hit_blocks_total": "kv_pool_hit_blocks",
    "pdserve_kvpool_lookup_blocks_total": "kv_pool_lookup_blocks",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("trace", type=Path, help="Mooncake .jsonl or Azure .csv (shared/traces/)")
    a("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    a("--limit", type=argtypes.positive_int, default=20, help="requests in the window (20)")
    a("--start-ms", type=argtypes.non_negative_float, default=0.0,
      help="the window opens at the first request at or after this trace time (0)")  # fmt: skip
    a("--length-scale", type=argtypes.positive_float, default=0.125,
      help="prompt, block and output lengths x this (1/8: 512-token blocks -> 64)")  # fmt: skip
    a("--time-scale", type=argtypes.positive_float, default=1.0,
      help="arrival times x this (2: half the trace's rate)")  # fmt: skip
    a("--json", type=Path, default=None, help="write the result JSON here")
    a("--prompt-format", choices=("text", "ids"), default="text",
      help="text: a token per word of --tokenizer (server-checked); ids: token ids")  # fmt: skip
    a("--tokenizer", default=None, help="the served model's (HF folder or .gguf; default model)")
    a("--max-model-len", type=argtypes.positive_int, default=None,
      help="context to fit requests into (default: the server's max_model_len)")  # fmt: skip
    a("--model", default=None, help="default: the first of GET /v1/models")
    a("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    a("--backend", choices=sorted(BACKENDS), default="openai",
      help="how exact output lengths are asked for (bench serve's --backend)")  # fmt: skip
    a("--slo-ttft", type=argtypes.positive_float, default=None, help="TTFT SLO, s")
    a("--slo-tpot", type=argtypes.positive_float, default=None, help="TPOT SLO, s")
    a("--seed", type=int, default=0, help="fixes each block id's text")
    a("--timeout", type=argtypes.positive_float, default=600.0, help="per request, s")
    a("--no-progress", action="store_true")


# ---------------------------------------------------------------------------- the server


async def _server_context(client: httpx.AsyncClient, base: str, headers: dict[str, str]) -> Any:
    resp = await client.get(f"{base}/v1/models", headers=headers)
    resp.raise_for_status()
    data = resp.json().get("data") or [{}]
    return data[0].get("max_model_len")


async def scrape(client: httpx.AsyncClient, base: str) -> dict[str, float] | None:
    """The `COUNTERS` of the server's /metrics, summed; None when it serves none."""
    try:
        resp = await client.get(f"{base}/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    sums = dict.fromkeys(COUNTERS.values(), 0.0)
    try:
        for family in text_string_to_metric_families(resp.text):
            for s in family.samples:
                if s.name in COUNTERS:
                    sums[COUNTERS[s.name]] += s.value
    except ValueError:  # not Prometheus text
        return None
    return sums


def server_reuse(
    before: dict[str, float] | None, after: dict[str, float] | None, refused_tokens: int = 0
) -> dict:
    """Prefix and KV-pool hits the server measured over the run (None without /metrics), over
    the prompts it admitted: the router counts a refused request's prompt tokens too, and no
    worker computes them (`refused_tokens`), which would read as hits."""
    if before is None or after is None:
        return {"prefix_hit_ratio": None, "kv_pool_hit_ratio": None}
    d = {k: after[k] - before[k] for k in after}
    sent, computed = d["prompt_tokens"] - refused_tokens, d["prefill_tokens"]
    hits, asked = d["kv_pool_hit_blocks"], d["kv_pool_lookup_blocks"]
    return {
        "prompt_tokens": sent,  # admitted
        "refused_prompt_tokens": refused_tokens,
        "computed_prompt_tokens": computed,
        "prefix_hit_ratio": max(0.0, 1.0 - computed / sent) if sent > 0 else None,
        "kv_pool_hit_blocks": hits,
        "kv_pool_lookup_blocks": asked,
        "kv_pool_hit_ratio": hits / asked if asked > 0 else None,
    }


async def _count_on_server(
    client: httpx.AsyncClient, url: str, model: str, headers: dict[str, str], text: str
) -> dict[str, Any]:
    body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0}
    resp = await client.post(url, json=body, headers=headers)
    if resp.status_code != 200:
        raise ValueError(f"the server refused a {len(text.split())}-word test prompt: "
                         f"HTTP {resp.status_code}: {resp.text[:300]}")  # fmt: skip
    usage = resp.json().get("usage")
    return usage if isinstance(usage, dict) else {}


async def _check_blocks(
    client: httpx.AsyncClient, url: str, model: str, headers: dict[str, str], bt: BlockText, n: int
) -> int | None:
    """The server's count of one `n`-token block (two blocks minus one); a mismatch is an
    error: the prompts would not have the trace's lengths or block boundaries."""
    one, two = bt.check(n)
    got = server_block_tokens(
        await _count_on_server(client, url, model, headers, one),
        await _count_on_server(client, url, model, headers, two),
    )
    if got is not None and got != n:
        raise ValueError(f"the server counts {got} tokens in a {n}-token block: --tokenizer is "
                         "not the served model's (or use --prompt-format ids)")  # fmt: skip
    return got


# ---------------------------------------------------------------------------- the run


def _prompts(args: argparse.Namespace, reqs: list[traces.TraceRequest]) -> tuple[list, Any]:
    if args.prompt_format == "ids":
        return [traces.prompt_ids(r, i, args.seed) for i, r in enumerate(reqs)], None
    from pdserve.engine.loader import load_tokenizer, resolve_model

    bt = BlockText(load_tokenizer(resolve_model(args.tokenizer)), args.seed)
    return [bt.prompt(r, i) for i, r in enumerate(reqs)], bt


async def _send_all(
    args: argparse.Namespace,
    client: httpx.AsyncClient,
    url: str,
    model: str,
    reqs: list[traces.TraceRequest],
    prompts: list[Any],
) -> tuple[list[RequestRecord], float]:
    """Each request at its arrival time (from now); the records and the run's duration."""
    from tqdm import tqdm

    headers = auth_headers(args.api_key)
    bar = tqdm(total=len(reqs), file=sys.stderr, disable=args.no_progress, unit="req")
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[None]] = []
    t_start = time.perf_counter()
    for i, (req, prompt) in enumerate(zip(reqs, prompts, strict=True)):
        delay = t_start + req.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        payload = completion_body(model, prompt, req.output_len)
        BACKENDS[args.backend](payload, req.output_len)
        rec = RequestRecord(i, i, 0, req.input_len, req.output_len)
        records.append(rec)
        task = asyncio.create_task(send_request(client, url, payload, headers, rec, t_start))
        task.add_done_callback(lambda _: bar.update(1))
        tasks.append(task)
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - t_start
    bar.close()
    return records, duration


async def run_replay(
    args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None
) -> dict[str, Any]:
    """Read, scale, check, replay; the result dict (`summarize`'s, plus the trace's scaling
    and the prefix reuse expected and measured)."""
    scaling = traces.Scaling(args.limit, args.start_ms, args.length_scale, args.time_scale)
    trace = traces.read_trace(args.trace, scaling)
    base, headers = args.url.rstrip("/"), auth_headers(args.api_key)
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    limits = httpx.Limits(max_connections=len(trace.requests) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        model = args.model or await fetch_model(client, base, headers)
        max_len = args.max_model_len or await _server_context(client, base, headers)
        reqs = trace.requests
        if isinstance(max_len, int):
            reqs = [traces.fit(r, max_len - 1) for r in reqs]  # -1: a BOS the server may add
        prompts, bt = _prompts(args, reqs)
        url = f"{base}/v1/completions"
        counted = None
        if bt is not None:
            counted = await _check_blocks(client, url, model, headers, bt, scaling.block_tokens)
        before = await scrape(client, base)
        if before is not None and bt is not None:  # the check's prefills are not the run's
            await asyncio.sleep(SETTLE_S)
            before = await scrape(client, base)
        records, duration = await _send_all(args, client, url, model, reqs, prompts)
        if before is not None:
            await asyncio.sleep(SETTLE_S)
        after = await scrape(client, base)
    trace = traces.Trace(trace.path, trace.format, scaling, reqs)
    refused = sum(r.prompt_len for r in records if r.rejected)
    server = server_reuse(before, after, refused)
    return _result(args, trace, model, max_len, records, duration, server, counted)


def _result(
    args: argparse.Namespace,
    trace: traces.Trace,
    model: str,
    max_len: Any,
    records: list[RequestRecord],
    duration: float,
    server: dict[str, Any],
    counted: int | None,
) -> dict[str, Any]:
    reqs = trace.requests
    spec = LoadSpec(
        url=args.url, num_requests=len(reqs), rate=math.inf, workload="replay",
        input_len=max(1, round(sum(r.input_len for r in reqs) / len(reqs))),
        output_len=max(1, round(sum(r.output_len for r in reqs) / len(reqs))),
        slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, seed=args.seed, model=model,
        prompt_format=args.prompt_format, backend=args.backend, send_user=False,
    )  # fmt: skip
    res = summarize(spec, model, "replay", records, duration)
    expected = traces.expected_prefix_hits(reqs)
    res["config"] = {
        **trace.config(),
        "url": args.url,
        "model": model,
        "max_model_len": max_len,
        "prompt_format": args.prompt_format,
        "server_block_tokens": counted,
        "seed": args.seed,
        "slo_ttft_s": args.slo_ttft,
        "slo_tpot_s": args.slo_tpot,
        "backend": args.backend,
        "ignore_eos": True,
    }
    res["prefix_hit_ratio"] = expected["prefix_hit_ratio"]
    res["server_prefix_hit_ratio"] = server["prefix_hit_ratio"]
    res["kv_pool_hit_ratio"] = server["kv_pool_hit_ratio"]
    res["prefix"] = {"trace": expected, "server": server}
    return res


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def format_replay(res: dict[str, Any]) -> str:
    cfg, server = res["config"], res["prefix"]["server"]
    pool = ""
    if server.get("kv_pool_lookup_blocks"):
        pool = (f"; KV pool {server['kv_pool_hit_blocks']:.0f} of "
                f"{server['kv_pool_lookup_blocks']:.0f} blocks looked up found")  # fmt: skip
    head = [
        f"bench replay: {cfg['trace']} ({cfg['format']}), {cfg['requests']} requests -> "
        f"{cfg['url']} ({cfg['model']})",
        f"scaling: {cfg['scaling']}; {cfg['truncated']} cut to fit {cfg['max_model_len']} "
        f"tokens; prompts as {cfg['prompt_format']}",
        f"prefix hit ratio: trace {_ratio(res['prefix_hit_ratio'])} (tokens of blocks seen "
        f"before / prompt tokens), server {_ratio(res['server_prefix_hit_ratio'])} (1 - prompt "
        f"tokens computed / sent){pool}",
    ]
    table = format_table({**res, "config": {**cfg, "rate": math.inf, "workload": "replay",
                                            "num_requests": cfg["requests"]}})  # fmt: skip
    return "\n".join(head + table.splitlines()[1:])


def run(args: argparse.Namespace) -> int:
    try:
        res = asyncio.run(run_replay(args))
    except httpx.HTTPError as e:
        raise ValueError(f"bench replay: {args.url}: {type(e).__name__}: {e}") from None
    print(format_replay(res))
    if args.json is not None:
        write_json(args.json, res, indent=1)
    return 0 if res["completed"] else 1
