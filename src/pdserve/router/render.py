"""How a finished or streaming generation becomes OpenAI's response objects: one renderer per
endpoint (completions, chat), each giving the first chunks, a chunk per delta, the usage chunk,
and the whole (non-streaming) response."""

from __future__ import annotations

from typing import Any

from pdserve.router import responses as r
from pdserve.router.flight import Delta
from pdserve.router.generation import Generation
from pdserve.router.tools import ToolPlan, ToolStream, call_deltas


class CompletionRender:
    def __init__(self, g: Generation, model: str) -> None:
        self.g, self.model = g, model

    def first(self) -> list[Any]:
        return []

    def chunk(self, delta: Delta) -> Any:
        logprobs = self.g.completion_logprobs(delta)
        self.g.text_offsets[delta.index] += len(delta.text)
        choice = r.CompletionChoice(
            index=delta.index, text=delta.text, finish_reason=delta.finish_reason, logprobs=logprobs
        )
        return r.CompletionChunk(id=self.g.rid, model=self.model, choices=[choice])

    def usage_chunk(self) -> Any:
        return r.CompletionChunk(id=self.g.rid, model=self.model, choices=[], usage=self.g.usage())

    def whole(self, deltas: list[Delta]) -> Any:
        choices = []
        for index, mine in enumerate(_by_choice(deltas, self.g.params.n)):
            text, finish = _text_and_finish(mine)
            logprobs = None
            if self.g.params.logprobs is not None:
                steps = [lp for d in mine for lp in d.logprobs or ()]
                logprobs = r.completion_logprobs(steps, self.g.s.token_text)
            choices.append(
                r.CompletionChoice(index=index, text=text, finish_reason=finish, logprobs=logprobs)
            )
        return r.CompletionResponse(
            id=self.g.rid, model=self.model, choices=choices, usage=self.g.usage()
        )


class ChatRender:
    def __init__(self, g: Generation, model: str, plan: ToolPlan | None = None) -> None:
        self.g, self.model, self.plan = g, model, plan
        self.streams = [ToolStream(plan) for _ in range(g.params.n)] if plan else []

    def first(self) -> list[Any]:
        return [
            r.ChatCompletionChunk(
                id=self.g.rid,
                model=self.model,
                choices=[
                    r.ChatChunkChoice(index=i, delta=r.ChatDelta(role="assistant", content=""))
                ],
            )
            for i in range(self.g.params.n)
        ]

    def chunk(self, delta: Delta) -> Any:
        content = delta.text if delta.text or delta.token_ids else None
        calls: list[r.ToolCall] = []
        if self.streams:
            stream = self.streams[delta.index]
            content = stream.feed(delta.text)
            if delta.finish_reason is not None:
                rest, calls = stream.finish()
                content += rest
            content = content or None
        choice = r.ChatChunkChoice(
            index=delta.index,
            delta=r.ChatDelta(content=content, tool_calls=call_deltas(calls) if calls else None),
            finish_reason=_finish(delta.finish_reason, calls),
            logprobs=self.g.chat_logprobs(delta),
        )
        return r.ChatCompletionChunk(id=self.g.rid, model=self.model, choices=[choice])

    def usage_chunk(self) -> Any:
        return r.ChatCompletionChunk(
            id=self.g.rid, model=self.model, choices=[], usage=self.g.usage()
        )

    def whole(self, deltas: list[Delta]) -> Any:
        choices = []
        for index, mine in enumerate(_by_choice(deltas, self.g.params.n)):
            text, finish = _text_and_finish(mine)
            logprobs = None
            if self.g.params.logprobs is not None:
                steps = [lp for d in mine for lp in d.logprobs or ()]
                logprobs = r.chat_logprobs(steps, self.g.s.token_text, self.g.top_n)
            content: str | None = text
            calls: list[r.ToolCall] = []
            if self.plan is not None:
                content, calls = self.plan.parse(text)
            choices.append(
                r.ChatChoice(
                    index=index,
                    message=r.AssistantMessage(content=content, tool_calls=calls or None),
                    finish_reason=_finish(finish, calls),
                    logprobs=logprobs,
                )
            )
        return r.ChatCompletionResponse(
            id=self.g.rid, model=self.model, choices=choices, usage=self.g.usage()
        )


Render = CompletionRender | ChatRender


def _finish(reason: str | None, calls: list[r.ToolCall]) -> str | None:
    """A choice that stopped with tool calls ended to call them (truncated: still "length")."""
    return "tool_calls" if calls and reason == "stop" else reason


def _by_choice(deltas: list[Delta], n: int) -> list[list[Delta]]:
    out: list[list[Delta]] = [[] for _ in range(n)]
    for d in deltas:
        out[d.index].append(d)
    return out


def _text_and_finish(deltas: list[Delta]) -> tuple[str, str | None]:
    text = "".join(d.text for d in deltas)
    return text, next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None)
