"""Tools (function calling) on chat completions: which tools the chat template is told about,
what constraint `tool_choice` puts on the output, and how the output becomes `tool_calls`.

- `none`: the template is not told about the tools; the output is plain content.
- `auto` (the default when tools are given): the template renders the tools; the model may answer
  or call tools the Hermes/Qwen way, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  which is parsed out of the text (a block that does not parse, or names no known tool, stays
  content). A template that does not know tools (the default SmolLM2's) never tells the model,
  so `auto` answers in plain text there.
- `required`: the output is constrained (grammar) to a JSON array of one or more calls
  `{"name": <a tool>, "arguments": <its parameters>}` (at most one with parallel_tool_calls false).
- a named function: the output is constrained to that function's parameters (a JSON object),
  which become its `arguments`.

A choice with tool calls ends with finish_reason "tool_calls" (also for a named function, where
OpenAI says "stop"); one truncated by max_tokens keeps "length" and its raw text as content.
Streamed, content goes out as it comes (held back from the first `<tool_call>` on) and each
call goes out whole, in the choice's last chunk.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.router import responses as r
from pdserve.router.errors import InvalidRequest

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TAG_OPEN) + r"\s*(.*?)\s*" + re.escape(TAG_CLOSE), re.DOTALL)
Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    functions: tuple[dict[str, Any], ...]  # each tool's "function" object: name, parameters, ...
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What apply_chat_template(tools=...) gets (None: the model is not told)."""
        if self.mode == "none" or not self.functions:
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    def spec(self) -> dict[str, Any] | None:
        """The grammar constraint tool_choice puts on the output."""
        if self.mode == "named":
            return {"json": _parameters(self._function(self.name))}
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in self.functions
            ]
            array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return {"json": array}
        return None

    def _function(self, name: str | None) -> dict[str, Any]:
        return next(f for f in self.functions if f["name"] == name)

    def parse(self, text: str) -> tuple[str | None, list[r.ToolCall]]:
        """(content, tool calls) of a finished choice's text."""
        if self.mode == "named":
            return _whole(text, lambda v: [(self.name or "", v)] if isinstance(v, dict) else None)
        if self.mode == "required":
            return _whole(text, _call_list)
        if self.mode == "none":
            return text, []
        calls: list[r.ToolCall] = []

        def take(m: re.Match[str]) -> str:
            call = self._block_call(m.group(1))
            if call is None:
                return m.group(0)  # not a call: stays content
            calls.append(call)
            return ""

        content = _BLOCK.sub(take, text)
        if calls and not content.strip():
            return None, calls
        return content, calls

    def _block_call(self, body: str) -> r.ToolCall | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        args = value.get("arguments", value.get("parameters", {}))
        return _call(value["name"], args)


def _whole(text: str, calls_of: Any) -> tuple[str | None, list[r.ToolCall]]:
    """The whole output is the call(s) as JSON (a grammar made sure, unless truncated)."""
    try:
        pairs = calls_of(json.loads(text))
    except json.JSONDecodeError:
        pairs = None
    if not pairs:
        return text, []  # truncated by max_tokens: the raw text, as content
    return None, [_call(name, args) for name, args in pairs]


def _call_list(value: Any) -> list[tuple[str, Any]] | None:
    if not isinstance(value, list):
        return None
    return [(c["name"], c["arguments"]) for c in value if isinstance(c, dict) and "name" in c]


def _call(name: str, arguments: Any) -> r.ToolCall:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return r.ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}", function=r.FunctionCall(name=name, arguments=args)
    )


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def plan(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The request's tool plan (None without tools); a bad tool or choice is a 400."""
    functions = tuple(_function_of(i, t) for i, t in enumerate(tools or ()))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: function names must be unique", "tools")
    choice = "auto" if tool_choice is None and functions else tool_choice
    if choice is None or choice == "none":
        return ToolPlan("none", functions) if functions else None
    if not functions:
        raise InvalidRequest(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "auto" or choice == "required":
        mode: Mode = "auto" if choice == "auto" else "required"
        return ToolPlan(mode, functions, parallel=parallel is not False)
    name = _named(choice)
    if name not in names:
        raise InvalidRequest(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return ToolPlan("named", functions, name, parallel is not False)


def _function_of(i: int, tool: Any) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise InvalidRequest(
            f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools"
        )
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise InvalidRequest(
            f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'", "tools"
        )
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema", "tools")
    return dict(fn)


def _named(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return str(fn["name"])
    raise InvalidRequest(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


class ToolStream:
    """One streamed choice under a tool plan: content deltas while no call can have begun, the
    calls (and any held-back content) at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text, self.sent = plan, "", 0

    def feed(self, text: str) -> str:
        """Content that can go out now."""
        self.text += text
        if self.plan.mode in ("named", "required"):
            return ""  # the whole output is the call
        if self.plan.mode == "none":
            limit = len(self.text)
        else:
            at = self.text.find(TAG_OPEN, self.sent)
            limit = at if at >= 0 else len(self.text) - _partial_tag(self.text)
        out = self.text[self.sent : max(limit, self.sent)]
        self.sent = max(limit, self.sent)
        return out

    def finish(self) -> tuple[str, list[r.ToolCall]]:
        """The content not sent yet, and the calls."""
        content, calls = self.plan.parse(self.text)
        rest = (content or "")[self.sent :] if content is not None else ""
        return rest, calls


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that could begin TAG_OPEN."""
    for k in range(min(len(TAG_OPEN) - 1, len(text)), 0, -1):
        if TAG_OPEN.startswith(text[-k:]):
            return k
    return 0


def call_deltas(calls: list[r.ToolCall]) -> list[r.ToolCallDelta]:
    return [r.ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(calls)]
