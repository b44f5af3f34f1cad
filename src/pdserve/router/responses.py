"""OpenAI wire format, the response side: completion / chat responses and streaming chunks,
usage, logprobs, and the model list. The request side (strict fields, validation, the error
envelope) is in protocol.py."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCall):
    """A streamed tool call: pdserve sends each call whole, in one delta, at its choice's end."""

    index: int


class _NoNullToolCalls(BaseModel):
    """`tool_calls` appears only when there are some (OpenAI's messages omit it otherwise)."""

    @model_serializer(mode="wrap")
    def _drop_null_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class AssistantMessage(_NoNullToolCalls):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_NoNullToolCalls):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pdserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- logprobs mapping --------------------------------------------------------------------------
def completion_logprobs(
    steps: list[dict[int, float]], token_text: Any, offset: int = 0
) -> CompletionLogprobs:
    """Per-token {token_id: logprob} (sampled token first, then the top-N) -> completions shape.

    `token_text(token_id) -> str`; `offset` is the text length already sent (for text_offset).
    """
    out = CompletionLogprobs()
    for step in steps:
        if not step:
            continue
        (tid, lp), *_ = step.items()
        text = token_text(tid)
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.top_logprobs.append({token_text(t): v for t, v in step.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(steps: list[dict[int, float]], token_text: Any, top_n: int) -> ChatLogprobs:
    """Per-token {token_id: logprob} (sampled first) -> chat's content list, top_n alternatives."""
    content = []
    for step in steps:
        if not step:
            continue
        (tid, lp), *_ = step.items()
        text = token_text(tid)
        ranked = sorted(step.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=lp,
                bytes=list(text.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=(t := token_text(i)), logprob=v, bytes=list(t.encode()))
                    for i, v in ranked
                ],
            )
        )
    return ChatLogprobs(content=content)
