"""`pdserve bench serve`: an async load generator for any OpenAI-compatible server.

Sends `--num-requests` streamed `POST {url}/v1/completions` requests (prompt as token ids, or
words with `--prompt-format text`, or the workload's own text for `rag`; `temperature: 0`; exactly
`max_tokens` tokens unless `--no-ignore-eos`, asked for in the dialect of `--backend`;
`stream_options.include_usage`), either at `--rate` requests/s with gamma inter-arrival times
(shape `--burstiness`, mean 1/rate; burstiness 1 is Poisson; `--rate inf` sends all at once) or
with at most `--concurrency` requests in flight. Turns of one multi-turn conversation are sent in
order, each after the previous finished (in rate mode an arrival whose next turn is not ready yet
waits for it); with `--multiturn-answers actual` (the default) a turn's prompt is the previous
turn's prompt + the answer the server returned + the new question (ids prompts: the answer text
re-tokenized with `--tokenizer`). Each request names its conversation in the OpenAI `user` field
("conv-<n>"; `--no-send-user` leaves it out), so a server can keep a conversation on one worker.

Rejections are results, not errors: an HTTP 429 or 503 answer (admission control, overload, no
workers) is recorded as `rejected`, with its latency (send -> status received), the error code of
its OpenAI error envelope (`error.code`, else `error.type`, else `http_<status>`) and its
Retry-After. The client never retries (httpx retries nothing on a status; no transport retries
are configured).

Metrics, as vLLM's `bench serve` (shared/design/ANCHORS.md), per completed request:
  * TTFT: send -> first streamed chunk with non-empty text;
  * E2E:  send -> last chunk with non-empty text (the usage-only chunk is not a token);
  * TPOT: (E2E - TTFT) / (output tokens - 1), for requests with >= 2 output tokens; output tokens
          from the final chunk's `usage.completion_tokens`, else the number of content chunks;
  * ITL:  every gap between consecutive content chunks, pooled over requests.
  * goodput: completed requests meeting every given SLO (`--slo-ttft`, `--slo-tpot`, seconds) per
    second of the run (with no SLO, every completed request is good); good_fraction =
    slo_attainment = good / sent; slo_attainment_admitted = good / admitted (sent - rejected).
    A failed request (other HTTP error, SSE error event, exception, a stream without content)
    counts in `failed` and never as good; a rejected one counts in `rejected` (by code), never
    as good, and not as failed.
  * rejection latency: p50/p99 of send -> 429/503 status; Retry-After values as sent.
  * by_phase: the same counts per item `phase` (shifting, mixed), goodput over each phase's span.
  * duration: first send -> last response; throughputs = completed totals / duration.
Percentiles are `pdserve.percentiles`' (numpy's linear interpolation). The HTTP client of one
request is `client.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from pdserve import argtypes
from pdserve.bench.harness.report import write_json
from pdserve.bench.load.client import (
    BACKENDS,
    ERROR_CHARS,
    auth_headers,
    fetch_model,
    payload,
    send_request,
    user_of,
)
from pdserve.bench.load.summary import RequestRecord, format_table, summarize
from pdserve.workloads import streams as wl
from pdserve.workloads.spec import THINK_DISTS, LoadSpec, arrival_gaps, default, think_times
from pdserve.workloads.streams import (
    WORKLOADS,
    RequestItem,
    Workload,
    ids_to_text,
    make_workload,
)


class Encoder(Protocol):
    """What turns an answer's text back into ids (a HF tokenizer)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


# ---------------------------------------------------------------------------- flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default=default("workload"))
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--rate",
        type=argtypes.positive_float,
        help="requests/s (gamma arrivals); 'inf': all at once",
    )
    mode.add_argument("--concurrency", type=argtypes.positive_int, help="max requests in flight")
    parser.add_argument(
        "--burstiness",
        type=argtypes.positive_float,
        default=default("burstiness"),
        help="gamma shape of inter-arrival times with --rate (1: Poisson, <1: burstier)",
    )
    parser.add_argument("--num-requests", type=argtypes.positive_int, required=True)
    parser.add_argument(
        "--input-len",
        type=argtypes.positive_int,
        default=default("input_len"),
        help="mean prompt ids",
    )
    parser.add_argument(
        "--output-len",
        type=argtypes.positive_int,
        default=default("output_len"),
        help="mean max_tokens",
    )
    parser.add_argument(
        "--len-spread",
        type=argtypes.fraction,
        default=default("len_spread"),
        help="lengths uniform in mean*(1 +- spread)",
    )
    parser.add_argument(
        "--turns",
        type=argtypes.positive_int,
        default=default("turns"),
        help="turns per conversation (multiturn)",
    )
    parser.add_argument(
        "--think-time",
        type=float,
        default=default("think_time"),
        help="seconds a conversation waits between an answer and its next turn (the mean; "
        "multiturn)",
    )
    parser.add_argument(
        "--think-dist",
        choices=THINK_DISTS,
        default=default("think_dist"),
        help="think times: exponential (seeded, mean --think-time) or fixed",
    )
    parser.add_argument(
        "--slo-ttft", type=argtypes.positive_float, default=default("slo_ttft"), help="TTFT SLO, s"
    )
    parser.add_argument(
        "--slo-tpot", type=argtypes.positive_float, default=default("slo_tpot"), help="TPOT SLO, s"
    )
    parser.add_argument("--seed", type=int, default=default("seed"))
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument(
        "--model", default=default("model"), help="default: the first of GET /v1/models"
    )
    parser.add_argument(
        "--api-key", default=default("api_key"), help="sent as 'Authorization: Bearer KEY'"
    )
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=default("ignore_eos"),
        help="send ignore_eos (a pdserve/vLLM extension; other servers ignore it)",
    )
    parser.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default=default("prompt_format"),
        help="ids: prompt as a list of token ids; text: one word per id (rag always sends text)",
    )
    parser.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default=default("backend"),
        help="how --ignore-eos is asked for: openai/pdserve/vllm: ignore_eos; llama-cpp: "
        "min_tokens; transformers: a generation_config with min_new_tokens",
    )
    parser.add_argument(
        "--tokenizer",
        default=default("tokenizer"),
        help="HF folder or .gguf whose tokenizer sizes rag prompts (default: the default model)",
    )
    parser.add_argument(
        "--timeout",
        type=argtypes.positive_float,
        default=default("timeout"),
        help="per-request timeout, s",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--send-user",
        action=argparse.BooleanOptionalAction,
        default=default("send_user"),
        help="send the conversation as the OpenAI `user` field (conv-<n>), for session affinity",
    )
    wl.add_arguments(parser)


# ---------------------------------------------------------------------------- one request


# ---------------------------------------------------------------------------- the run


class _Ready:
    """Items whose conversation has no turn in flight, in workload order, plus the waiting ones.

    Conversations are queued in the order of their first item; a conversation's next turn is
    released (to the back of the queue) when its previous turn finishes, so conversations
    interleave."""

    def __init__(self, items: list[RequestItem], think: Callable[[], float] | None = None) -> None:
        self.think = think  # seconds before a conversation's next turn is released
        self._pending: dict[int, deque[RequestItem]] = {}
        for it in items:
            self._pending.setdefault(it.conversation, deque()).append(it)
        self._queue: asyncio.Queue[RequestItem] = asyncio.Queue()
        for q in self._pending.values():
            self._queue.put_nowait(q.popleft())

    async def get(self) -> RequestItem:
        return await self._queue.get()

    def done(self, item: RequestItem) -> None:
        q = self._pending[item.conversation]
        if not q:
            return
        delay = self.think() if self.think is not None else 0.0
        if delay > 0:
            asyncio.get_running_loop().call_later(delay, self._queue.put_nowait, q.popleft())
        else:
            self._queue.put_nowait(q.popleft())


class _Conversations:
    """Prompts of multi-turn conversations that carry their actual answers.

    An item with a `question` is sent as (the previous turn's prompt + the answer it got) + the
    question; the first turn as the question alone. Text prompts append the answer's text as it
    was streamed; ids prompts append the answer re-tokenized by `encoder` (the served model's
    tokenizer, so the prompt extends what the server computed). A turn that was rejected or
    failed adds no answer. Deterministic given the server's answers (greedy)."""

    def __init__(self, text: bool, encoder: Encoder | None) -> None:
        self.text, self.encoder = text, encoder
        self.history: dict[int, str | list[int]] = {}

    def prompt(self, item: RequestItem) -> str | list[int]:
        assert item.question is not None
        prev = self.history.get(item.conversation) if item.turn else None
        if self.text:
            question = ids_to_text(item.question)
            return question if prev is None else f"{prev} {question}"
        assert prev is None or isinstance(prev, list)
        return list(item.question) if prev is None else [*prev, *item.question]

    def finished(self, item: RequestItem, prompt: str | list[int], answer: str) -> None:
        if isinstance(prompt, str):
            self.history[item.conversation] = prompt + answer
            return
        ids: list[int] = []
        if answer:
            assert self.encoder is not None
            ids = [int(t) for t in self.encoder.encode(answer, add_special_tokens=False)]
        self.history[item.conversation] = [*prompt, *ids]


def _prompt_len(prompt: str | list[int]) -> int:
    return len(prompt.split()) if isinstance(prompt, str) else len(prompt)


def _default_encoder(args: LoadSpec) -> Encoder:
    from pdserve.engine.loader import load_tokenizer, resolve_model

    tokenizer: Encoder = load_tokenizer(resolve_model(getattr(args, "tokenizer", None)))
    return tokenizer


async def run_benchmark(
    args: LoadSpec,
    workload: Workload | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    encoder: Encoder | None = None,
) -> dict[str, Any]:
    """Run the load and return the result dict (see `summarize`).

    `encoder` turns answers back into ids for multi-turn ids prompts (default: `--tokenizer`'s,
    loaded only when needed); `transport` replaces the HTTP transport (tests)."""
    from tqdm import tqdm

    workload = workload if workload is not None else make_workload(args)
    items = list(workload)
    item_at = getattr(workload, "item_at", None)  # a workload choosing items by time
    text_prompts = args.prompt_format == "text"
    carries = any(it.question is not None and it.turn > 0 for it in items)
    if carries and not text_prompts and encoder is None:
        encoder = await asyncio.to_thread(_default_encoder, args)
    convs = _Conversations(text_prompts, encoder)
    base = args.url.rstrip("/")
    headers = auth_headers(args.api_key)
    n_conn = args.concurrency or len(items)
    limits = httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn)
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as client:
        model = args.model or await fetch_model(client, base, headers)
        url = f"{base}/v1/completions"
        ready = _Ready(items, think_times(args.think_time, args.think_dist, args.seed))
        records: list[RequestRecord] = []
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        gaps = arrival_gaps(args.rate, args.burstiness, len(items), args.seed) if args.rate else []
        bar = tqdm(total=len(items), file=sys.stderr, disable=args.no_progress, unit="req")

        async def one(item: RequestItem, rec: RequestRecord) -> None:
            try:
                prompt = convs.prompt(item) if item.question is not None else None
                if prompt is not None:
                    rec.prompt_len = _prompt_len(prompt)
                body = payload(args, model, item, prompt)
                await send_request(client, url, body, headers, rec, t_start)
                if prompt is not None:
                    convs.finished(item, prompt, rec.answer if rec.ok else "")
            except Exception as e:  # building the prompt (tokenizer) fails this request only
                rec.error = rec.error or f"{type(e).__name__}: {e}"[:ERROR_CHARS]
            finally:
                ready.done(item)
                bar.update(1)
                if sem is not None:
                    sem.release()

        tasks: list[asyncio.Task[None]] = []
        t_start = time.perf_counter()
        next_send = t_start
        for i in range(len(items)):
            if sem is not None:
                await sem.acquire()
            else:
                next_send += gaps[i] if i else 0.0  # the first request goes at t = 0
                delay = next_send - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            if item_at is not None:
                item = item_at(i, time.perf_counter() - t_start)
            else:
                item = await ready.get()
            rec = RequestRecord(
                i,
                item.conversation,
                item.turn,
                len(item.prompt),
                item.max_tokens,
                phase=item.phase,
                user=user_of(item) if getattr(args, "send_user", True) else None,
            )
            records.append(rec)
            tasks.append(asyncio.create_task(one(item, rec)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_start
        bar.close()
    return summarize(args, model, workload.name, records, duration)


def run(args: argparse.Namespace) -> int:
    res = asyncio.run(run_benchmark(LoadSpec.from_args(args)))
    print(format_table(res))
    if args.result_json is not None:
        write_json(args.result_json, res, indent=1)
    return 0 if res["completed"] or res["rejected"] else 1  # refusals are results too


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, httpx.HTTPError) as e:
        print(f"pdserve bench serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
