"""`pdserve bench mlperf --url URL --target-qps Q`: MLPerf Inference LoadGen's Server scenario
against a running server, through its OpenAI streaming endpoint.

LoadGen (the `mlcommons-loadgen` package, `mlperf_loadgen`) issues queries at Poisson arrivals
of `--target-qps` until it has sent `--min-query-count` and run `--min-duration-s`, and decides
whether the run is VALID: with token latencies on (`use_token_latencies`), its TTFT and TPOT
percentiles (`server_target_latency_percentile`, 99% by default) must meet `--ttft-ms` and
`--tpot-ms` (LoadGen's `ttft_latency` / `tpot_latency`), and enough queries must have run.

The data set is the seeds' knowledge-base QA: the `rag` workload's prompts (workloads/rag.py:
a question from data/kb/questions.jsonl with the passages BM25 ranks highest, rendered with the
tokenizer's chat template, about `--input-len` tokens), one sample per question. Each query is
one streamed `POST /v1/completions` (`max_tokens` = `--output-len`, EOS ignored, greedy): the
first chunk with text is reported to LoadGen with `FirstTokenComplete` (TTFT), the end of the
stream with `QuerySamplesComplete` and the tokens the server counted (usage.completion_tokens:
TPOT). A query that fails is completed with 0 tokens and counted; any failure makes the
command's verdict INVALID whatever LoadGen says.

LoadGen writes mlperf_log_summary.txt (the verdict and the measured percentiles) and
mlperf_log_detail.txt in `--output-dir`; the verdict and the summary's results are printed.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import httpx

from pdserve import argtypes
from pdserve.bench.load.serve_bench import fetch_model
from pdserve.workloads.spec import LoadSpec

SUMMARY = "mlperf_log_summary.txt"
DETAIL = "mlperf_log_detail.txt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    a("--target-qps", type=argtypes.positive_float, required=True, help="LoadGen's Poisson rate")
    a("--min-query-count", type=argtypes.positive_int, default=100,
      help="queries at least (100; early stopping wants several hundred for VALID)")  # fmt: skip
    a("--min-duration-s", type=argtypes.positive_float, default=60.0,
      help="seconds at least (60; MLPerf's own rule is 600)")  # fmt: skip
    a("--ttft-ms", type=argtypes.positive_float, default=2000.0, help="TTFT limit (2000 ms)")
    a("--tpot-ms", type=argtypes.positive_float, default=200.0, help="TPOT limit (200 ms)")
    a("--percentile", type=argtypes.fraction, default=0.99, help="of TTFT and TPOT (0.99)")
    a("--output-dir", type=Path, default=Path("mlperf-results"), help="LoadGen's logs")
    a("--input-len", type=argtypes.positive_int, default=512, help="prompt tokens (512)")
    a("--output-len", type=argtypes.positive_int, default=64, help="max_tokens (64)")
    a("--tokenizer", default=None, help="renders and sizes the prompts (the served model's)")
    a("--model", default=None, help="default: the first of GET /v1/models")
    a("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    a("--seed", type=int, default=0)
    a("--timeout", type=argtypes.positive_float, default=600.0, help="per query, s")


def _loadgen() -> Any:
    try:
        import mlperf_loadgen
    except ImportError:
        raise ValueError("bench mlperf needs MLPerf LoadGen: pip install mlcommons-loadgen "
                         "(a pdserve dependency: `make setup` installs it)") from None  # fmt: skip
    return mlperf_loadgen


def _samples(args: argparse.Namespace) -> list[str]:
    """The knowledge-base QA prompts, one per question (workloads/rag.py)."""
    from pdserve.workloads.rag import load_questions
    from pdserve.workloads.streams import make_workload

    spec = LoadSpec(
        url=args.url, num_requests=len(load_questions()), rate=1.0, workload="rag",
        input_len=args.input_len, output_len=args.output_len, seed=args.seed,
        tokenizer=args.tokenizer,
    )  # fmt: skip
    return [item.text or "" for item in make_workload(spec)]


def settings(lg: Any, args: argparse.Namespace) -> Any:
    s = lg.TestSettings()
    s.scenario = lg.TestScenario.Server
    s.mode = lg.TestMode.PerformanceOnly
    s.server_target_qps = args.target_qps
    s.use_token_latencies = True
    s.ttft_latency = int(args.ttft_ms * 1e6)  # ns
    s.tpot_latency = int(args.tpot_ms * 1e6)
    s.server_target_latency_percentile = args.percentile
    s.min_query_count = args.min_query_count
    s.min_duration_ms = int(args.min_duration_s * 1e3)
    s.schedule_rng_seed = s.sample_index_rng_seed = s.qsl_rng_seed = args.seed
    return s


class OpenAISut:
    """LoadGen's system under test: each query a streamed completion on an asyncio loop in a
    thread of its own (LoadGen calls `issue` from its thread and must not be kept waiting)."""

    def __init__(self, lg: Any, args: argparse.Namespace) -> None:
        self.lg, self.args = lg, args
        self.prompts: list[str] = []  # set before the test starts
        self.model = ""  # set by connect()
        self.failed: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client = self._call(self._open())
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def connect(self) -> None:
        """The model to ask for (the first of /v1/models unless --model): a server that is not
        there fails here, before the data set is built."""
        if self.args.model:
            self.model = self.args.model
            return
        self.model = self._call(fetch_model(self.client, self.base, self.headers))

    @property
    def base(self) -> str:
        return str(self.args.url).rstrip("/")

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _open(self) -> httpx.AsyncClient:
        timeout = httpx.Timeout(self.args.timeout, connect=min(self.args.timeout, 30.0))
        return httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))

    def issue(self, queries: list[Any]) -> None:
        for q in queries:
            asyncio.run_coroutine_threadsafe(self._query(q.id, q.index), self.loop)

    def flush(self) -> None:
        pass

    def _respond(self, first: bool, qid: int, text: str, tokens: int | None = None) -> None:
        data = array.array("B", text.encode())  # kept alive until LoadGen has copied it
        ptr, n = data.buffer_info()
        if first:
            self.lg.FirstTokenComplete([self.lg.QuerySampleResponse(qid, ptr, n)])
        else:
            self.lg.QuerySamplesComplete([self.lg.QuerySampleResponse(qid, ptr, n, tokens or 0)])

    async def _query(self, qid: int, index: int) -> None:
        body = {"model": self.model, "prompt": self.prompts[index],
                "max_tokens": self.args.output_len, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        text, tokens, first = "", 0, False
        try:
            text, tokens, first = await self._stream(qid, body)
        except Exception as e:  # a failed query still completes, with 0 tokens (and is counted)
            self.failed.append(f"{type(e).__name__}: {e}"[:300])
            tokens = 0
        if not first:
            self._respond(True, qid, "")
        self._respond(False, qid, text, tokens)

    async def _stream(self, qid: int, body: dict[str, Any]) -> tuple[str, int, bool]:
        url, text, usage, first = f"{self.base}/v1/completions", "", None, False
        async with self.client.stream("POST", url, json=body, headers=self.headers) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"SSE error: {obj['error']}")
                piece = (obj.get("choices") or [{}])[0].get("text") or ""
                if piece and not first:
                    self._respond(True, qid, piece)
                    first = True
                text += piece
                usage = obj.get("usage") or usage
        tokens = int(usage["completion_tokens"]) if usage else 0
        if tokens < 1:
            raise RuntimeError("the stream ended without tokens")
        return text, tokens, first

    def close(self) -> None:
        self._call(self.client.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def verdict(summary: str) -> str:
    """VALID or INVALID, as LoadGen's summary says ("Result is : VALID")."""
    for line in summary.splitlines():
        if line.strip().startswith("Result is"):
            return line.split(":", 1)[1].strip()
    return "INVALID"


def _start(lg: Any, args: argparse.Namespace, sut_impl: OpenAISut) -> None:
    """LoadGen's run, its logs in --output-dir; returns when every query has completed."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    n = len(sut_impl.prompts)
    sut = lg.ConstructSUT(sut_impl.issue, sut_impl.flush)
    qsl = lg.ConstructQSL(n, n, lambda _: None, lambda _: None)  # every prompt is in memory
    out = lg.LogOutputSettings()
    out.outdir, out.copy_summary_to_stdout = str(args.output_dir), False
    logs = lg.LogSettings()
    logs.log_output = out
    try:
        lg.StartTestWithLogSettings(sut, qsl, settings(lg, args), logs)
    finally:
        lg.DestroyQSL(qsl)
        lg.DestroySUT(sut)


def run_loadgen(args: argparse.Namespace, prompts: list[str] | None = None) -> dict[str, Any]:
    """One LoadGen Server run; its verdict, the summary's text and the failures."""
    lg = _loadgen()
    sut_impl = OpenAISut(lg, args)
    try:
        sut_impl.connect()
        sut_impl.prompts = prompts if prompts is not None else _samples(args)
        _start(lg, args, sut_impl)
    finally:
        sut_impl.close()
    summary = (args.output_dir / SUMMARY).read_text()
    result = verdict(summary) if not sut_impl.failed else "INVALID"
    return {"verdict": result, "summary": summary, "failed": sut_impl.failed}


def _results_part(summary: str) -> str:
    """The summary's verdict part and its median and p99 latencies (the rest is in the file)."""
    head, _, stats = summary.partition("Additional Stats")
    keep = [line for line in head.splitlines() if line.strip() and "====" not in line]
    keep += [line for line in stats.splitlines() if line.startswith(("50.00", "99.00"))]
    return "\n".join(keep)


def run(args: argparse.Namespace) -> int:
    try:
        res = run_loadgen(args)
    except httpx.HTTPError as e:
        raise ValueError(f"bench mlperf: {args.url}: {type(e).__name__}: {e}") from None
    print(_results_part(res["summary"]))
    if res["failed"]:
        print(f"{len(res['failed'])} queries failed, e.g. {res['failed'][0]}")
    print(f"logs: {args.output_dir / SUMMARY}, {args.output_dir / DETAIL}")
    print(f"verdict: {res['verdict']}")
    return 0 if res["verdict"] == "VALID" else 1
