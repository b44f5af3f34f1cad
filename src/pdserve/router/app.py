"""The OpenAI-compatible HTTP front of the router (FastAPI).

    app = create_app(core, tokenizer, model_name="smollm2", api_key=None, max_model_len=2048)
    uvicorn.run(app, port=8000)

Routes: POST /v1/completions and /v1/chat/completions (SSE when `stream`), GET /v1/models,
GET /health, GET /metrics, GET /admin/workers, GET /admin/kvpool, GET/POST /admin/pools
(router/pools.py), GET /v1/requests/{id}/timeline, and the live dashboard: GET /dashboard (the
page) and GET /admin/dashboard.json (its data; router/dashboard.py).
The response `id` is the request id the core used, so a request's timeline is reachable by it.

Every error is OpenAI's envelope `{"error": {"message", "type", "param", "code"}}`: 400 for bad
parameters (validation errors included), 401 for a missing or wrong key when `api_key` is set
(/health and /metrics stay open), 404 for an unknown model or route, 405, 413 for a body over
`max_body_bytes`, and the core's `RequestError` statuses (429, 503, ...). A 500 means a bug here.

Streams end with `data: [DONE]`; an error after the stream started is sent as one
`data: {"error": ...}` event before it. When a client goes away, the core's generator is closed
(which aborts the request on the workers): between chunks (`request.is_disconnected()`), while
waiting for the next token (Starlette cancels the stream on http.disconnect), and when a send
fails (the response closes its body iterator in every case).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from pdserve.engine.grammar import check_spec
from pdserve.engine.request import SamplingParams
from pdserve.router import dashboard, pools, structured, tools
from pdserve.router import protocol as p
from pdserve.router import responses as r
from pdserve.router.core import Delta, RequestError
from pdserve.router.gate import Gate, error_response
from pdserve.router.render import ChatRender, CompletionRender, Render

log = logging.getLogger("pdserve.router")

DEFAULT_CHAT_MAX_TOKENS = 1024  # chat without max_tokens and no known max_model_len
DISCONNECT_POLL_S = 0.25  # how often a request waiting on the core checks for its client
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client disconnected while its request was waiting on the core."""


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator however the stream ends (done, cancelled, or a failed send)."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def _pull(gen: AsyncIterator[Delta]) -> Delta | None:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


async def _watching(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class _Generation:
    """One request on its way through the core: ids, params, its generator, usage, logprobs."""

    def __init__(
        self,
        app_state: _AppState,
        request: Request,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        top_n: int,
        session: str | None = None,
    ) -> None:
        self.s, self.request, self.rid = app_state, request, rid
        self.prompt_ids, self.params, self.top_n = prompt_ids, params, top_n
        # the OpenAI `user` field names the conversation: the core keeps it where its KV is
        self.gen: AsyncIterator[Delta] = app_state.core.generate(
            rid, prompt_ids, params, session=session
        )
        self.completion_tokens = 0
        self.text_offsets = [0] * params.n  # per choice

    def seen(self, delta: Delta) -> None:
        self.completion_tokens += len(delta.token_ids)
        if self.s.metrics is not None and delta.token_ids:
            self.s.metrics.on_delta(self.rid, len(delta.token_ids), time.monotonic())

    async def next(self) -> Delta | None:
        delta = await _pull(self.gen)
        if delta is not None:
            self.seen(delta)
        return delta

    async def aclose(self) -> None:
        aclose = getattr(self.gen, "aclose", None)
        if aclose is not None:
            await aclose()

    def usage(self) -> r.Usage:
        return r.Usage.of(len(self.prompt_ids), self.completion_tokens)

    def completion_logprobs(self, delta: Delta) -> r.CompletionLogprobs | None:
        if self.params.logprobs is None or not delta.logprobs:
            return None
        offset = self.text_offsets[delta.index]
        return r.completion_logprobs(delta.logprobs, self.s.token_text, offset)

    def chat_logprobs(self, delta: Delta) -> r.ChatLogprobs | None:
        if self.params.logprobs is None or not delta.logprobs:
            return None
        return r.chat_logprobs(delta.logprobs, self.s.token_text, self.top_n)


class _AppState:
    def __init__(
        self,
        core: Any,
        tokenizer: Any,
        model_name: str,
        max_model_len: int | None,
        metrics: Any,
    ) -> None:
        self.core, self.tokenizer, self.model_name = core, tokenizer, model_name
        self.max_model_len, self.metrics = max_model_len, metrics
        self.vocab_size = len(tokenizer)
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text

    def reject(self, request: Request, e: p.InvalidRequest) -> JSONResponse:
        if self.metrics is not None and request.method == "POST":
            self.metrics.on_rejected(e.code)
        return error_response(e.status, e.message, param=e.param, code=e.code)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise p.InvalidRequest(
                f"The model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
                status=404,
            )

    def check_prompt(self, ids: list[int]) -> p.Context | None:
        """Validate prompt ids; returns the context max_tokens must fit in (None: unknown)."""
        if not ids:
            raise p.InvalidRequest("prompt must not be empty", "prompt", "empty_prompt")
        if self.max_model_len is not None and len(ids) >= self.max_model_len:
            raise p.InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {len(ids)} tokens, leaving no room to generate",
                "prompt",
                "context_length_exceeded",
            )
        if self.max_model_len is None:
            return None
        return p.Context(self.max_model_len, len(ids))

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """What only the vocabulary can tell: logit_bias token ids."""
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise p.InvalidRequest(
                f"logit_bias token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                "logit_bias",
            )
        return params

    async def completion_ids(self, req: p.CompletionRequest) -> list[int]:
        prompt = req.prompt_input()
        if isinstance(prompt, str):
            if not prompt:
                return []
            return list(await run_in_threadpool(self.tokenizer.encode, prompt))
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise p.InvalidRequest(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt"
            )
        return list(prompt)

    async def chat_ids(
        self, req: p.ChatCompletionRequest, tool_plan: tools.ToolPlan | None = None
    ) -> list[int]:
        messages = req.template_messages()
        extra = {}
        if tool_plan is not None and tool_plan.template_tools() is not None:
            extra["tools"] = tool_plan.template_tools()

        def encode() -> list[int]:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **extra
            )
            return list(self.tokenizer.encode(text, add_special_tokens=False))

        try:
            return await run_in_threadpool(encode)
        except Exception as e:  # the template refuses this conversation (roles, order, ...)
            raise p.InvalidRequest(f"cannot apply the chat template: {e}", "messages") from None


# ---- the app -----------------------------------------------------------------------------------
def create_app(
    core: Any,
    tokenizer: Any,
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 4 << 20,
    max_model_len: int | None = None,
    metrics: Any = None,
    scaler: Any = None,
) -> FastAPI:
    """The HTTP app over `core` (a RouterCore or anything with its interface).

    `metrics` (a `pdserve.metrics.Metrics`) is served at /metrics, fed per delta by the app, and
    attached to the core (`core.metrics`) when the core has none yet. `scaler` (router/pools.py)
    resizes the pools at /admin/pools when the deployment can start and stop workers.
    """
    if metrics is not None and getattr(core, "metrics", None) is None:
        core.metrics = metrics
    s = _AppState(core, tokenizer, model_name, max_model_len, metrics)
    board = dashboard.Dashboard(core, metrics, scaler)
    app = FastAPI(
        title="pdserve",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=dashboard.lifespan(board),
    )
    app.state.pdserve = s
    app.add_middleware(Gate, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)

    # ---- error handlers: the OpenAI envelope everywhere ------------------------------------
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            code: str | None = "not_found"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        return error_response(exc.status_code, message, code=code, headers=dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(p.validation_error_body(list(exc.errors())), status_code=400)

    @app.exception_handler(p.InvalidRequest)
    async def invalid_request(request: Request, exc: p.InvalidRequest) -> JSONResponse:
        return s.reject(request, exc)

    @app.exception_handler(RequestError)
    async def core_error(request: Request, exc: RequestError) -> JSONResponse:
        retry = exc.retry_after_s
        headers = {"Retry-After": str(retry)} if retry is not None else None
        return error_response(exc.status, exc.message, code=exc.code, headers=headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error")

    # ---- generation --------------------------------------------------------------------------
    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        req = p.parse_request(p.CompletionRequest, await request.body())
        s.check_model(req.model)
        ids = await s.completion_ids(req)
        context = s.check_prompt(ids)
        spec, _ = structured.request_spec(req.structured_fields())
        params = s.check_params(req.to_sampling_params(context, spec))
        rid = f"cmpl-{uuid.uuid4().hex}"
        g = _Generation(s, request, rid, ids, params, req.logprobs or 0, req.user)
        if req.stream:
            return await _stream(g, req.include_usage, CompletionRender(g, s.model_name))
        best = BestOf(req.n or 1, req.logprobs) if params.n != (req.n or 1) else None
        return await _collect(g, CompletionRender(g, s.model_name), best)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        req = p.parse_request(p.ChatCompletionRequest, await request.body())
        s.check_model(req.model)
        plan = tools.plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        ids = await s.chat_ids(req, plan)
        context = s.check_prompt(ids)
        default = context.room if context is not None else DEFAULT_CHAT_MAX_TOKENS
        spec = _chat_constraint(req, plan)
        params = s.check_params(req.to_sampling_params(default, context, spec))
        top_n = req.top_logprobs or 0
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        g = _Generation(s, request, rid, ids, params, top_n, req.user)
        if req.stream:
            return await _stream(g, req.include_usage, ChatRender(g, s.model_name, plan))
        return await _collect(g, ChatRender(g, s.model_name, plan))

    # ---- models, health, metrics, admin --------------------------------------------------------
    def model_card() -> r.ModelCard:
        root = str(getattr(core, "model", "") or "") or None
        return r.ModelCard(id=model_name, created=s.created, root=root, max_model_len=max_model_len)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return r.ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        s.check_model(model_id)
        return model_card().model_dump()

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy: dict[str, int] = {"prefill": 0, "decode": 0, "colocated": 0}
        for row in core.worker_table():
            if row.get("healthy") and row.get("role") in healthy:
                healthy[row["role"]] += 1
        serving = (healthy["prefill"] > 0 and healthy["decode"] > 0) or healthy["colocated"] > 0
        if serving:
            return JSONResponse({"status": "ok", "healthy_workers": healthy})
        if any(healthy.values()):
            # one role's pool is empty: the rest runs whole requests (counted as local_fallbacks)
            return JSONResponse({"status": "degraded", "healthy_workers": healthy})
        body = p.error_body(503, "no healthy workers to serve requests", code="no_healthy_workers")
        return JSONResponse(
            {"status": "unavailable", "healthy_workers": healthy, **body}, status_code=503
        )

    @app.get("/metrics")
    async def metrics_text() -> Response:
        if metrics is None:
            return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
        return Response(metrics.render(), headers={"Content-Type": metrics.content_type})

    @app.get("/admin/workers")
    async def workers() -> list[dict[str, Any]]:
        return list(core.worker_table())

    @app.get("/admin/kvpool")
    async def kvpool() -> dict[str, Any]:
        """Per worker: its KV pools, what the pool did for its requests and the tiers' own
        stats (from the stats each worker reports); the router's pool index and counters."""
        report = getattr(core, "kvpool", None)
        return report() if report is not None else {"workers": {}, "index": {}, "router": {}}

    @app.get("/v1/requests/{rid}/timeline")
    async def timeline(rid: str) -> JSONResponse:
        events = core.timeline(rid)
        if events is None:
            return error_response(
                404, f"no request {rid!r} (unknown, or too old)", param="id", code="not_found"
            )
        predicted = getattr(core, "prediction", None)
        body = {"id": rid, "object": "request.timeline", "events": events}
        body["prediction"] = predicted(rid) if predicted is not None else None
        return JSONResponse(body)

    @app.post("/admin/workers/{worker_id}/role")
    async def set_role(worker_id: str, request: Request) -> JSONResponse:
        """Drain the worker, switch its role, let it rejoin (no request is lost)."""
        req = p.parse_request(p.RoleRequest, await request.body())
        row = await core.set_role(worker_id, req.role, by="admin")
        return JSONResponse(row)

    dashboard.mount(app, board)  # GET /dashboard, GET /admin/dashboard.json
    pools.mount(app, scaler)  # GET/POST /admin/pools
    return app


def _chat_constraint(
    req: p.ChatCompletionRequest, plan: tools.ToolPlan | None
) -> dict[str, Any] | None:
    """The grammar of a chat request: from tool_choice (required / a named function) or from
    response_format / guided_*; not both."""
    spec, source = structured.request_spec(req.structured_fields())
    tool_spec = plan.spec() if plan is not None else None
    if tool_spec is None:
        return spec
    if spec is not None:
        raise p.InvalidRequest(
            f"tool_choice {req.tool_choice!r} constrains the output already; drop {source}",
            source,
        )
    try:
        check_spec(tool_spec)
    except ValueError as e:
        raise p.InvalidRequest(f"tools: a function's parameters: {e}", "tools") from None
    return tool_spec


# ---- rendering: completions and chat, whole and streamed -------------------------------------
async def _collect(g: _Generation, render: Render, best: BestOf | None = None) -> Response:
    """Run the request to its end; the client's disconnect aborts it. `best`: keep only the
    best_of candidates with the highest cumulative logprob."""

    async def run() -> list[Delta]:
        deltas = []
        while (delta := await g.next()) is not None:
            deltas.append(delta)
        return deltas

    try:
        deltas = await _watching(g.request, run())
    except ClientGone:
        return Response(status_code=499)
    finally:
        await g.aclose()
    if best is not None:
        deltas = best.pick(deltas)
        g.params = dataclasses.replace(g.params, n=best.n, logprobs=best.logprobs)
    return JSONResponse(render.whole(deltas).model_dump())


class BestOf:
    """best_of on completions: the n candidates with the highest cumulative logprob, re-indexed
    0..n-1 in rank order; their logprobs stay only when the client asked for them."""

    def __init__(self, n: int, logprobs: int | None) -> None:
        self.n, self.logprobs = n, logprobs

    def pick(self, deltas: list[Delta]) -> list[Delta]:
        score: dict[int, float] = {}
        for d in deltas:
            steps = zip(d.token_ids, d.logprobs or (), strict=False)
            score[d.index] = score.get(d.index, 0.0) + sum(lp[t] for t, lp in steps)
        ranked = sorted(score, key=lambda i: -score[i])[: self.n]
        rank = {index: r for r, index in enumerate(ranked)}
        return [
            dataclasses.replace(
                d, index=rank[d.index], logprobs=d.logprobs if self.logprobs is not None else None
            )
            for d in deltas
            if d.index in rank
        ]


async def _stream(g: _Generation, include_usage: bool, render: Render) -> Response:
    """SSE stream; an error before the first delta is a plain HTTP error instead."""
    try:
        first = await _watching(g.request, g.next())
    except ClientGone:
        await g.aclose()
        return Response(status_code=499)
    except BaseException:
        await g.aclose()
        raise

    exclude = None if include_usage else {"usage"}

    def dump(chunk: Any) -> str:
        return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"

    async def events() -> AsyncIterator[str]:
        delta: Delta | None = first
        try:
            for chunk in render.first():
                yield dump(chunk)
            while delta is not None:
                yield dump(render.chunk(delta))
                if await g.request.is_disconnected():
                    return  # finally: closing the core's generator aborts the request
                delta = await g.next()
            if include_usage:
                yield dump(render.usage_chunk())
        except RequestError as e:
            yield _sse(p.error_body(e.status, e.message, code=e.code))
        except Exception as e:  # a bug: tell the client, end the stream cleanly
            log.exception("internal error in stream %s", g.rid)
            yield _sse(p.error_body(500, f"internal error: {type(e).__name__}"))
        finally:
            with anyio.CancelScope(shield=True):
                await g.aclose()
        yield SSE_DONE

    return _ClosingStreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
