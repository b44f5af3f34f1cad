"""How a generation becomes the HTTP response: whole (`collect`, with best_of's pick) or an SSE
stream (`stream`); a client that goes away aborts the request either way."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Send

from pdserve.router.errors import error_body
from pdserve.router.flight import Delta, RequestError
from pdserve.router.generation import ClientGone, Generation, watching
from pdserve.router.render import Render

log = logging.getLogger("pdserve.router")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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


async def collect(g: Generation, render: Render, best: BestOf | None = None) -> Response:
    """Run the request to its end; the client's disconnect aborts it. `best`: keep only the
    best_of candidates with the highest cumulative logprob."""

    async def run() -> list[Delta]:
        deltas = []
        while (delta := await g.next()) is not None:
            deltas.append(delta)
        return deltas

    try:
        deltas = await watching(g.request, run())
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


async def stream(g: Generation, include_usage: bool, render: Render) -> Response:
    """SSE stream; an error before the first delta is a plain HTTP error instead."""
    try:
        first = await watching(g.request, g.next())
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
            yield _sse(error_body(e.status, e.message, code=e.code))
        except Exception as e:  # a bug: tell the client, end the stream cleanly
            log.exception("internal error in stream %s", g.rid)
            yield _sse(error_body(500, f"internal error: {type(e).__name__}"))
        finally:
            with anyio.CancelScope(shield=True):
                await g.aclose()
        yield SSE_DONE

    return _ClosingStreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
