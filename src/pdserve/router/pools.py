"""POST /admin/pools and GET /admin/pools: resize the prefill, decode and colocated pools.

The router does not start processes (that is the composition roots' work): a deployment that can
add and stop workers hands the app a `Scaler` — today `pdserve.ray.pools.RayPools`, under
`pdserve serve --ray`. Without one both routes answer 409 with an OpenAI error envelope saying so;
role switches (POST /admin/workers/{id}/role) still move workers between the pools. When the
router moves threads between P and D (`--adaptive`), GET shows the split under `threads` (and
answers 200 without a scaler: `resizable` false).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pdserve.router import protocol as p
from pdserve.router.errors import InvalidRequest
from pdserve.router.gate import error_response

MAX_POOL = 64


class Scaler(Protocol):
    def resize(self, targets: dict[str, int], by: str = "admin") -> dict[str, Any]: ...
    def status(self) -> dict[str, Any]: ...


class PoolsRequest(BaseModel):
    """POST /admin/pools: the number of workers wanted per pool; pools left out keep theirs."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prefill: int | None = Field(default=None, ge=0, le=MAX_POOL)
    decode: int | None = Field(default=None, ge=0, le=MAX_POOL)
    colocated: int | None = Field(default=None, ge=0, le=MAX_POOL)

    def targets(self) -> dict[str, int]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


NO_SCALER = (
    "this server cannot add or stop workers: start it with `pdserve serve --ray ...` to resize "
    "pools (POST /admin/workers/{id}/role moves a worker between pools)"
)


def mount(
    app: FastAPI, scaler: Scaler | None, threads: Callable[[], dict[str, Any]] | None = None
) -> None:
    """`threads`: the thread mover's status (router/thread_moves.py), when there is one."""

    @app.get("/admin/pools")
    async def pools() -> JSONResponse:
        split = {"threads": threads()} if threads is not None else {}
        if scaler is None:
            if split:
                return JSONResponse({"resizable": False, **split})
            return error_response(409, NO_SCALER, code="no_scaler")
        return JSONResponse({**scaler.status(), **split})

    @app.post("/admin/pools")
    async def resize(request: Request) -> JSONResponse:
        req = p.parse_request(PoolsRequest, await request.body())
        if scaler is None:
            return error_response(409, NO_SCALER, code="no_scaler")
        targets = req.targets()
        if not targets:
            raise InvalidRequest("give at least one of prefill, decode, colocated", "prefill")
        return JSONResponse(scaler.resize(targets), status_code=202)
