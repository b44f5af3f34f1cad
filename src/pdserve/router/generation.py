"""One request of the HTTP front on its way through the core (`Generation`), the app's state
and per-request checks (`AppState`: model name, prompt ids against the vocabulary and the
context, tokenizing), and waiting on the core while watching for the client to go away."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from pdserve.engine.request import SamplingParams
from pdserve.router import protocol as p
from pdserve.router import responses as r
from pdserve.router import tools
from pdserve.router.errors import InvalidRequest
from pdserve.router.flight import Delta
from pdserve.router.gate import error_response

DISCONNECT_POLL_S = 0.25  # how often a request waiting on the core checks for its client


class ClientGone(Exception):
    """The client disconnected while its request was waiting on the core."""


async def pull(gen: AsyncIterator[Delta]) -> Delta | None:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


async def watching(request: Request, work: Awaitable[Any]) -> Any:
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


class Generation:
    """One request on its way through the core: ids, params, its generator, usage, logprobs."""

    def __init__(
        self,
        app_state: AppState,
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
        delta = await pull(self.gen)
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


class AppState:
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

    def reject(self, request: Request, e: InvalidRequest) -> JSONResponse:
        if self.metrics is not None and request.method == "POST":
            self.metrics.on_rejected(e.code)
        return error_response(e.status, e.message, param=e.param, code=e.code)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise InvalidRequest(
                f"The model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
                status=404,
            )

    def check_prompt(self, ids: list[int]) -> p.Context | None:
        """Validate prompt ids; returns the context max_tokens must fit in (None: unknown)."""
        if not ids:
            raise InvalidRequest("prompt must not be empty", "prompt", "empty_prompt")
        if self.max_model_len is not None and len(ids) >= self.max_model_len:
            raise InvalidRequest(
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
            raise InvalidRequest(
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
            raise InvalidRequest(
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
            raise InvalidRequest(f"cannot apply the chat template: {e}", "messages") from None
