"""The ASGI gate in front of the OpenAI app: the API key and the body size are checked before
anything parses the request (a 401 / 413 in OpenAI's error envelope), and the body is read here,
counted, and replayed to the app."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router import dashboard
from pdserve.router.errors import error_body

# reachable without the API key (the dashboard page is static code; its data needs the key)
OPEN_PATHS = frozenset({"/health", "/metrics", dashboard.PAGE_PATH})


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | int | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param=param, code=code), status_code=status, headers=headers
    )


class Gate:
    def __init__(
        self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, metrics: Any = None
    ) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.metrics = metrics

    def _rejected(self, scope: Scope, code: str) -> None:
        if self.metrics is not None and scope["method"] == "POST":
            self.metrics.on_rejected(code)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            ):
                message = (
                    "Incorrect API key provided"
                    if token
                    else "Missing API key: send it as 'Authorization: Bearer <key>'"
                )
                self._rejected(scope, "invalid_api_key")
                await error_response(401, message, code="invalid_api_key")(scope, receive, send)
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = headers.get("content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_body_bytes
            except ValueError:
                await error_response(400, "invalid Content-Length header", code="invalid_request")(
                    scope, receive, send
                )
                return
            if too_big:
                await self._too_large(scope, receive, send)
                return
        chunks, size = [], 0
        while True:  # read the whole body here, counting, so an undeclared size is capped too
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then disconnect notices, as usual

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._rejected(scope, "request_too_large")
        response = error_response(
            413,
            f"request body exceeds {self.max_body_bytes} bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)
