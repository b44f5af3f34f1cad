"""OpenAI wire format, the request side: request models and their validation (errors.py has the
error envelope, responses.py the response and streaming-chunk models).

Requests are strict: a field pdserve does not know is a 400 in OpenAI's words ("Unrecognized
request argument supplied: X"), and an OpenAI field it knows but does not serve (`tools` on
completions, `echo`, ...) is a 400 naming it unless it carries its no-op default (clients often
send `tools: []`). Nothing is ignored silently. vLLM's extensions pdserve serves are accepted
(`top_k`, `ignore_eos`, `stop_token_ids`, `repetition_penalty`, `guided_*`,
`structured_outputs`); structured.py and tools.py turn the constraint fields into a grammar.
`to_sampling_params` turns a request into the engine's
`SamplingParams`; its validation errors become `InvalidRequest` with the parameter name, and a
max_tokens that does not fit the context beside the prompt is a 400 (`context_length_exceeded`),
never clamped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    ValidationError,
    field_validator,
    model_validator,
)

from pdserve.engine.request import SamplingParams
from pdserve.router.errors import InvalidRequest, validation_error_body

# Below this a temperature is treated as greedy (dividing logits by ~0 would overflow).
GREEDY_EPS = 1e-5
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
MAX_BEST_OF = 20  # OpenAI's limit
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
# The ints of a request travel to the workers as msgpack, 64-bit: a larger one (e.g. {"top_k":
# 18446744073709551616}) made the router's send fail with OverflowError, a 500. Refused here: 400.
WireInt = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]

_M = TypeVar("_M", bound=BaseModel)


def parse_request(cls: type[_M], body: bytes) -> _M:
    """Parse a JSON body into `cls`; any problem is an `InvalidRequest` (400)."""
    if not body.strip():
        raise InvalidRequest("request body is empty; send a JSON object", code="invalid_json")
    try:
        return cls.model_validate_json(body)
    except ValidationError as e:
        env = validation_error_body(e.errors(include_url=False))["error"]
        raise InvalidRequest(env["message"], env["param"], env["code"]) from None


# ---- requests ----------------------------------------------------------------------------------
def _none(v: Any) -> bool:
    return v is None


def _falsy(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {} or v == ""


def _none_or(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v in values


class _Strict(BaseModel):
    """Every field a client sends is served, refused by name, or accepted only at its no-op
    value (`NOOP_DEFAULTS`: name -> accepts the value); never dropped silently."""

    model_config = ConfigDict(extra="forbid")
    NOOP_DEFAULTS: ClassVar[dict[str, Callable[[Any], bool]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key in list(data):
            if key in cls.model_fields:
                continue
            accepts = cls.NOOP_DEFAULTS.get(key)
            if accepts is None:
                raise InvalidRequest(
                    f"Unrecognized request argument supplied: {key}",
                    str(key),
                    "unknown_parameter",
                )
            if not accepts(data[key]):
                raise InvalidRequest(
                    f"{key} is not supported by pdserve (only its default, "
                    f"{_NOOP_HINTS.get(key, 'null')}, is accepted)",
                    str(key),
                    "unsupported_parameter",
                )
            del data[key]  # its no-op value: nothing to do
        return data


# How each accepted no-op value is described in the refusal of any other value.
_NOOP_HINTS = {
    "response_format": '{"type": "text"}',
    "tools": "[]",
    "tool_choice": '"none"',
    "functions": "[]",
    "function_call": '"none"',
    "parallel_tool_calls": "null",
    "store": "false",
    "metadata": "{}",
    "service_tier": '"auto"',
    "modalities": '["text"]',
    "suffix": '""',
    "best_of": "1",
    "tool_calls": "[]",
    "refusal": "null",
    "annotations": "[]",
}
_REQUEST_NOOPS: dict[str, Callable[[Any], bool]] = {
    "tools": _falsy,
    "tool_choice": _none_or("none"),
    "functions": _falsy,
    "function_call": _none_or("none"),
    "parallel_tool_calls": _none,
    "store": _falsy,
    "metadata": _falsy,
    "service_tier": _none_or("auto", "default"),
    "modalities": _none_or(["text"]),
    "audio": _none,
    "prediction": _none,
    "reasoning_effort": _none,
    "web_search_options": _none,
}


class StreamOptions(_Strict):
    include_usage: bool = False
    NOOP_DEFAULTS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "continuous_usage_stats": _falsy,  # vLLM
        "include_obfuscation": _falsy,
    }


class _SamplingFields(_Strict):
    """Fields completions and chat share (OpenAI names and defaults; vLLM extensions)."""

    model: str
    # Finite only: pydantic's JSON parser takes NaN and Infinity, and a NaN temperature passed
    # SamplingParams to make the worker's sampler raise mid engine step, killing the worker.
    temperature: FiniteFloat | None = 1.0
    top_p: FiniteFloat | None = 1.0
    top_k: WireInt | None = -1  # extension
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[WireInt] | None = None  # extension
    ignore_eos: bool = False  # extension
    n: WireInt | None = 1  # choices: one prefill, n sequences forked from it
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the conversation: the router keeps it where its KV is
    presence_penalty: FiniteFloat | None = 0.0
    frequency_penalty: FiniteFloat | None = 0.0
    repetition_penalty: FiniteFloat | None = 1.0  # extension
    logit_bias: dict[str, FiniteFloat] | None = None
    # Structured outputs (at most one; router/structured.py): OpenAI's and vLLM's spellings.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # extension
    guided_regex: str | None = None  # extension
    guided_choice: list[str] | None = None  # extension
    guided_grammar: str | None = None  # extension (Lark)
    structured_outputs: dict[str, Any] | None = None  # extension: {json|regex|choice|...: ...}
    NOOP_DEFAULTS: ClassVar[dict[str, Callable[[Any], bool]]] = _REQUEST_NOOPS

    def structured_fields(self) -> dict[str, Any]:
        """The fields that constrain the output, by name (None when absent)."""
        return {name: getattr(self, name) for name in _STRUCTURED_FIELDS}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _params(
        self, max_tokens: int, logprobs: int | None, structured: dict[str, Any] | None
    ) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        if 0 <= temperature < GREEDY_EPS:
            temperature = 0.0
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None or self.top_k == 0 else self.top_k,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if self.repetition_penalty is None else self.repetition_penalty
                ),
                logit_bias=dict(self.logit_bias) if self.logit_bias else None,  # type: ignore[arg-type]
                n=1 if self.n is None else self.n,
                structured_outputs=structured,
            )
        except ValueError as e:
            raise InvalidRequest(str(e), _param_of(str(e))) from None


_STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
_PARAM_NAMES = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "n",
)


def _param_of(message: str) -> str | None:
    """SamplingParams' messages start with the field they are about ("top_p must be ...")."""
    first = message.split(" ", 1)[0]
    return first if first in _PARAM_NAMES else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: WireInt | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False
    # best_of candidates are generated (n = best_of forked from one prefill), the n with the
    # highest cumulative logprob are returned; usage counts every candidate's tokens, as OpenAI's
    best_of: WireInt | None = None

    @property
    def candidates(self) -> int:
        """How many choices to generate (best_of, else n)."""
        n = 1 if self.n is None else self.n
        return n if self.best_of is None else self.best_of

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError(
                    f"one prompt per request: send a single string or token-id list "
                    f"(got a batch of {len(v)})"
                )
            return v[0]  # type: ignore[no-any-return]
        return v  # type: ignore[no-any-return]

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return False

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text, or token ids (a one-element batch was unwrapped)."""
        return self.prompt  # type: ignore[return-value]

    NOOP_DEFAULTS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **_REQUEST_NOOPS,
        "suffix": _falsy,
    }

    def to_sampling_params(
        self, context: Context | None = None, structured: dict[str, Any] | None = None
    ) -> SamplingParams:
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        if context is not None:
            context.check(max_tokens, "prompt")
        n = 1 if self.n is None else self.n
        if self.candidates == n:
            return self._params(max_tokens, self.logprobs, structured)
        if not n <= self.candidates <= MAX_BEST_OF:
            raise InvalidRequest(
                f"best_of must be between n ({n}) and {MAX_BEST_OF}, got {self.best_of}", "best_of"
            )
        if self.stream:
            raise InvalidRequest("best_of > n cannot be streamed", "best_of")
        # every candidate's sampled-token logprob ranks it (logprobs 0 when not asked for)
        params = self._params(max_tokens, self.logprobs or 0, structured)
        return dataclasses.replace(params, n=self.candidates)


class Context:
    """The model's context window and the prompt's length: what max_tokens must fit beside."""

    def __init__(self, max_model_len: int, prompt_tokens: int) -> None:
        self.max_model_len, self.prompt_tokens = max_model_len, prompt_tokens

    @property
    def room(self) -> int:
        return self.max_model_len - self.prompt_tokens

    def check(self, max_tokens: int, param: str) -> None:
        """OpenAI's 400 (its wording and code) when prompt + max_tokens exceeds the context."""
        if max_tokens <= self.room:
            return
        total, p, n = self.prompt_tokens + max_tokens, self.prompt_tokens, max_tokens
        if param == "messages":
            message = (
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({p} in the messages, {n} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        else:
            message = (
                f"This model's maximum context length is {self.max_model_len} tokens, however "
                f"you requested {total} tokens ({p} in your prompt; {n} for the completion). "
                "Please reduce your prompt; or completion length."
            )
        raise InvalidRequest(message, param, "context_length_exceeded")


class ContentPart(BaseModel):
    # Lenient on purpose: a part's other fields belong to its type, and every type but 'text'
    # is refused by name in ChatMessage.text().
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    NOOP_DEFAULTS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        # what the openai client's own assistant message holds when sent back as history
        "refusal": _none,
        "annotations": _falsy,
        "audio": _none,
        "function_call": _none,
    }
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, sent back as history
    tool_call_id: str | None = None  # a tool's answer: to which call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise InvalidRequest(
                    f"content parts of type {part.type!r} are not supported (only 'text')",
                    "messages",
                )
            out.append(part.text)
        return "".join(out)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: WireInt | None = None
    max_completion_tokens: WireInt | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    tools: list[Any] | None = None  # router/tools.py checks them
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def conversation(self) -> str:
        """The conversation this request is a turn of: `user` when given, else a hash of the
        messages up to the first user message, which every turn of a conversation starts with
        (two conversations opening alike share it: affinity only, the KV is matched by hash)."""
        if self.user:
            return self.user
        end = next((i for i, msg in enumerate(self.messages) if msg.role == "user"), 0)
        opening = [msg.model_dump(exclude_none=True) for msg in self.messages[: end + 1]]
        digest = hashlib.sha256(json.dumps(opening, sort_keys=True).encode()).hexdigest()
        return f"messages-{digest[:32]}"

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template wants them (text; 'developer' is 'system'; tool calls
        with their arguments as objects, as Hermes/Qwen templates render them)."""
        out = []
        for msg in self.messages:
            item: dict[str, Any] = {
                "role": "system" if msg.role == "developer" else msg.role,
                "content": msg.text(),
            }
            if msg.tool_calls:
                item["tool_calls"] = [_template_call(c) for c in msg.tool_calls]
            if msg.tool_call_id is not None:
                item["tool_call_id"] = msg.tool_call_id
            out.append(item)
        return out

    def to_sampling_params(
        self,
        max_tokens_default: int,
        context: Context | None = None,
        structured: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """`max_tokens_default` when the client gives neither limit (the context's room)."""
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        requested = self.max_completion_tokens
        if requested is None:
            requested = self.max_tokens
        max_tokens = max_tokens_default if requested is None else requested
        if context is not None and requested is not None:
            context.check(max_tokens, "messages")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._params(max_tokens, logprobs, structured)
        except InvalidRequest as e:
            if e.param == "max_tokens" and self.max_completion_tokens is not None:
                e.param = "max_completion_tokens"
            raise


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as templates take it: function.arguments as an object when it is
    JSON text (the openai client sends text)."""
    fn = call.get("function") or {}
    if not isinstance(fn, dict):  # a client's mistake, answered 400 (dict() would raise: a 500)
        raise InvalidRequest(
            f"messages: a tool call's function must be an object, got {type(fn).__name__}",
            "messages",
        )
    fn = dict(fn)
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: the template gets the text
            fn["arguments"] = json.loads(args)
    return {**call, "function": fn}


# ---- responses ---------------------------------------------------------------------------------


class RoleRequest(BaseModel):
    """POST /admin/workers/{id}/role"""

    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]
