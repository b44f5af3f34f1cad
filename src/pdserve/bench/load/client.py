"""The HTTP client of every load bench (`bench serve`, `bench replay`, `bench mlperf`): one
streamed `POST /v1/completions` and what it measured, into a `RequestRecord`.

A request asks for `temperature: 0`, streams with `stream_options.include_usage`, and, when the
load asks for exact lengths, asks for exactly `max_tokens` tokens in the dialect of its server
(`BACKENDS`). `send_request` times the stream (TTFT, ITL, E2E, TPOT as `serve_bench`'s module
docstring defines them) and records a refusal (HTTP 429/503: rejected, with its code and
Retry-After) apart from a failure; it never raises. `fetch_model` asks a server what it serves.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import httpx

from pdserve.bench.load.summary import RequestRecord
from pdserve.workloads.spec import LoadSpec
from pdserve.workloads.streams import RequestItem, ids_to_text

ERROR_CHARS = 300
REJECT_STATUSES = frozenset({429, 503})  # answers that are a refusal, recorded as `rejected`


def auth_headers(api_key: str | None) -> dict[str, str]:
    """`Authorization: Bearer KEY` when a key is given (`--api-key`)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def completion_body(model: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy, streamed completion that reports its usage at the end."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _exact_length_ignore_eos(payload: dict[str, Any], n: int) -> None:
    payload["ignore_eos"] = True


def _exact_length_min_tokens(payload: dict[str, Any], n: int) -> None:
    payload["min_tokens"] = n  # llama-cpp-python: EOS is masked until n tokens


def _exact_length_generation_config(payload: dict[str, Any], n: int) -> None:
    # `transformers serve` answers 422 to unknown fields; its own knob is a GenerationConfig
    # (which replaces the model's defaults: so greedy and the length are spelled out here)
    cfg = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
    payload["generation_config"] = json.dumps(cfg)


# --backend -> how a request asks for exactly max_tokens tokens (EOS ignored), so every server
# generates the same number of tokens for the same item
BACKENDS: dict[str, Callable[[dict[str, Any], int], None]] = {
    "openai": _exact_length_ignore_eos,
    "pdserve": _exact_length_ignore_eos,
    "vllm": _exact_length_ignore_eos,
    "llama-cpp": _exact_length_min_tokens,
    "transformers": _exact_length_generation_config,
}


def _prompt(args: LoadSpec, item: RequestItem) -> str | list[int]:
    if item.text is not None:
        return item.text
    return ids_to_text(item.prompt) if args.prompt_format == "text" else item.prompt


def user_of(item: RequestItem) -> str:
    return f"conv-{item.conversation}"


def payload(
    args: LoadSpec,
    model: str,
    item: RequestItem,
    prompt: str | list[int] | None = None,
) -> dict[str, Any]:
    """The body of a workload item's request (`prompt`: a multi-turn prompt built already)."""
    body = completion_body(
        model, _prompt(args, item) if prompt is None else prompt, item.max_tokens
    )
    if getattr(args, "send_user", True):
        body["user"] = user_of(item)
    if args.ignore_eos:
        BACKENDS[getattr(args, "backend", "openai")](body, item.max_tokens)
    return body


def _retry_after(value: str | None) -> float | None:
    try:
        v = float(value) if value is not None else None
    except ValueError:  # an HTTP date: not used by the servers benchmarked here
        return None
    return v if v is not None and math.isfinite(v) else None


def _reject_code(status: int, body: bytes) -> str:
    """`error.code` of an OpenAI error envelope (else its `type`), or "http_<status>"."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        for key in ("code", "type"):
            if err.get(key) not in (None, ""):
                return str(err[key])
    return f"http_{status}"


def _sse_error(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return f"unexpected SSE data: {str(obj)[:ERROR_CHARS]}"
    err = obj.get("error")
    if err is None and obj.get("object") != "error":
        return None
    if isinstance(err, dict):
        err = err.get("message", err)
    return f"SSE error: {err if err is not None else obj.get('message', obj)}"


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    rec: RequestRecord,
    t_start: float,
) -> None:
    """Stream one completion into `rec` (timings, tokens or the error); never raises."""
    t0 = time.perf_counter()
    rec.send_s = t0 - t_start
    first = last = None
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code in REJECT_STATUSES:
                rec.reject_ms = (time.perf_counter() - t0) * 1e3
                rec.rejected = True
                rec.retry_after_s = _retry_after(resp.headers.get("retry-after"))
                rec.reject_code = _reject_code(resp.status_code, await resp.aread())
                return
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:ERROR_CHARS]}"
                return
            event = ""
            async for line in resp.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                    continue
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                err = _sse_error(obj) if event != "error" else f"SSE error: {data[:ERROR_CHARS]}"
                if err is not None:
                    rec.error = err
                    return
                if rec.response_id is None and isinstance(obj.get("id"), str):
                    rec.response_id = obj["id"]
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    rec.answer += choices[0]["text"]
                    if first is None:
                        first = now
                    else:
                        assert last is not None
                        rec.itl_ms.append((now - last) * 1e3)
                    last = now
                    chunks += 1
                usage = obj.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
    except Exception as e:  # any transport or parsing failure fails this request only
        rec.error = f"{type(e).__name__}: {e}"[:ERROR_CHARS]
        return
    if first is None or last is None:
        rec.error = "stream ended without content"
        return
    rec.output_tokens = usage_tokens if usage_tokens else chunks
    rec.ttft_ms = (first - t0) * 1e3
    rec.e2e_ms = (last - t0) * 1e3
    if rec.output_tokens > 1:
        rec.tpot_ms = (rec.e2e_ms - rec.ttft_ms) / (rec.output_tokens - 1)


async def fetch_model(
    client: httpx.AsyncClient, base: str, headers: dict[str, str], timeout: float = 30.0
) -> str:
    resp = await client.get(f"{base}/v1/models", headers=headers, timeout=timeout)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{base}/v1/models lists no model; pass --model")
    return str(data[0]["id"])
