"""The OpenAI-compatible HTTP front of the router (FastAPI).

    app = create_app(core, tokenizer, model_name="smollm2", api_key=None, max_model_len=2048)
    uvicorn.run(app, port=8000)

Routes: POST /v1/completions and /v1/chat/completions (SSE when `stream`), GET /v1/models,
GET /health, GET /metrics, GET /admin/workers, GET /admin/kvpool, GET/POST /admin/pools
(router/pools.py), GET /admin/steps?since= (the workers' engine steps: router/step_logs.py),
GET /v1/requests/{id}/timeline, and the live dashboard: GET /dashboard (the page) and
GET /admin/dashboard.json (its data; router/dashboard.py).
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

import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.engine.grammar import check_spec
from pdserve.router import dashboard, pools, respond, structured, tools
from pdserve.router import protocol as p
from pdserve.router import responses as r
from pdserve.router.errors import InvalidRequest, error_body, validation_error_body
from pdserve.router.flight import RequestError
from pdserve.router.gate import Gate, error_response
from pdserve.router.generation import AppState, Generation
from pdserve.router.render import ChatRender, CompletionRender

log = logging.getLogger("pdserve.router")

DEFAULT_CHAT_MAX_TOKENS = 1024  # chat without max_tokens and no known max_model_len


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
    s = AppState(core, tokenizer, model_name, max_model_len, metrics)
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
        return JSONResponse(validation_error_body(list(exc.errors())), status_code=400)

    @app.exception_handler(InvalidRequest)
    async def invalid_request(request: Request, exc: InvalidRequest) -> JSONResponse:
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
        g = Generation(s, request, rid, ids, params, req.logprobs or 0, req.user)
        if req.stream:
            return await respond.stream(g, req.include_usage, CompletionRender(g, s.model_name))
        best = respond.BestOf(req.n or 1, req.logprobs) if params.n != (req.n or 1) else None
        return await respond.collect(g, CompletionRender(g, s.model_name), best)

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
        g = Generation(s, request, rid, ids, params, top_n, req.conversation())
        if req.stream:
            return await respond.stream(g, req.include_usage, ChatRender(g, s.model_name, plan))
        return await respond.collect(g, ChatRender(g, s.model_name, plan))

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
        body = error_body(503, "no healthy workers to serve requests", code="no_healthy_workers")
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

    @app.get("/admin/steps")
    async def steps(since: float = 0.0) -> dict[str, Any]:
        """Each healthy worker's engine steps begun at or after `since` (time.monotonic() on
        the workers' host) and the router's clock now (router/step_logs.py)."""
        links = getattr(core, "links", None)
        if links is None:
            return {"since": since, "workers": {}, "threads": {}, "missing": [],
                    "now": time.monotonic()}  # fmt: skip
        out = await links.step_logs.collect(core.workers, since)
        return {**out, "now": time.monotonic()}

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
        spec = getattr(getattr(core, "timelines", None), "spec", None)  # router/timelines.py
        body["speculation"] = spec.get(rid) if isinstance(spec, dict) else None
        return JSONResponse(body)

    @app.post("/admin/workers/{worker_id}/role")
    async def set_role(worker_id: str, request: Request) -> JSONResponse:
        """Drain the worker, switch its role, let it rejoin (no request is lost)."""
        req = p.parse_request(p.RoleRequest, await request.body())
        row = await core.set_role(worker_id, req.role, by="admin")
        return JSONResponse(row)

    dashboard.mount(app, board)  # GET /dashboard, GET /admin/dashboard.json
    mover = getattr(getattr(core, "roles", None), "threads", None)  # --adaptive's split
    pools.mount(app, scaler, None if mover is None else mover.status)  # GET/POST /admin/pools
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
        raise InvalidRequest(
            f"tool_choice {req.tool_choice!r} constrains the output already; drop {source}",
            source,
        )
    try:
        check_spec(tool_spec)
    except ValueError as e:
        raise InvalidRequest(f"tools: a function's parameters: {e}", "tools") from None
    return tool_spec
