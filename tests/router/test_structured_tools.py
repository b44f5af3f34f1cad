"""Structured outputs and tools in the HTTP layer (fake core, no workers): which constraint a
request carries to the workers, 400s for bad schemas/regexes/tools, tool-call parsing into
message.tool_calls (whole and streamed), finish_reason "tool_calls", the template told the tools."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_core import FakeCore
from fastapi.testclient import TestClient
from test_app import MODEL, chat, completion, events

from pdserve.router.app import create_app
from pdserve.router.core import Delta
from pdserve.router.tools import ToolStream, plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture
def core() -> FakeCore:
    return FakeCore()


@pytest.fixture
def client(core: FakeCore, tool_tokenizer: Any) -> TestClient:
    app = create_app(core, tool_tokenizer, model_name=MODEL, max_model_len=512)
    return TestClient(app, raise_server_exceptions=False)


def _spec(core: FakeCore) -> Any:
    return core.calls[-1][2].structured_outputs


# ---- the constraint each spelling carries -------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "spec"),
    [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            {"json": SCHEMA},
        ),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
        ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"guided_grammar": 'start: "a"+'}, {"grammar": 'start: "a"+'}),
        ({"structured_outputs": {"regex": "a|b"}}, {"regex": "a|b"}),
    ],
)
def test_constraint_reaches_the_sampling_params(client, core, body, spec) -> None:  # type: ignore[no-untyped-def]
    assert chat(client, max_tokens=2, **body).status_code == 200
    assert _spec(core) == spec
    assert completion(client, max_tokens=2, **body).status_code == 200  # both endpoints
    assert _spec(core) == spec


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "must be 'text'"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'name'"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 3}},
                }
            },
            "response_format",
            "invalid",
        ),
        ({"guided_regex": "(["}, "guided_regex", "invalid"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"yaml": 1}}, "structured_outputs", "unknown constraint"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one way"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0]"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "guided_regex",
            "constrains the output already",
        ),
    ],
)
def test_bad_constraints_and_tools_are_400(client, body, param, words) -> None:  # type: ignore[no-untyped-def]
    r = chat(client, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


# ---- tools ----------------------------------------------------------------------------------
def test_auto_tells_the_template_and_parses_calls(client, core, tool_tokenizer) -> None:  # type: ignore[no-untyped-def]
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    text = f"Let me check. <tool_call>{call}</tool_call>"
    core.script(Delta([5], text, None, "stop"))
    r = chat(client, tools=[WEATHER])
    assert r.status_code == 200, r.text
    _, ids, params = core.calls[-1]
    prompt = tool_tokenizer.decode(ids)
    assert "get_weather" in prompt and params.structured_outputs is None  # auto: unconstrained
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check. "
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_none_hides_the_tools_and_a_plain_answer_has_no_tool_calls(
    client, core, tool_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    core.script(Delta([5], "Just text", None, "stop"))
    r = chat(client, tools=[WEATHER], tool_choice="none")
    assert "get_weather" not in tool_tokenizer.decode(core.calls[-1][1])
    msg = r.json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Just text"}  # no tool_calls key at all
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_required_and_named_use_the_grammar(client, core) -> None:  # type: ignore[no-untyped-def]
    core.script(
        Delta(
            [5],
            '[{"name": "get_time", "arguments": {}}, '
            '{"name": "get_weather", "arguments": {"city": "Rome"}}]',
            None,
            "stop",
        )
    )
    r = chat(client, tools=[WEATHER, TIME], tool_choice="required")
    spec = _spec(core)["json"]
    assert spec["type"] == "array" and spec["minItems"] == 1 and "maxItems" not in spec
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert r.json()["choices"][0]["message"]["content"] is None
    chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert _spec(core)["json"]["maxItems"] == 1

    core.script(Delta([5], '{"city": "Paris"}', None, "stop"))
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tools=[WEATHER, TIME], tool_choice=named)
    assert _spec(core) == {"json": WEATHER["function"]["parameters"]}  # type: ignore[index]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }


def test_truncated_call_keeps_length_and_the_raw_text(client, core) -> None:  # type: ignore[no-untyped-def]
    core.script(Delta([5], '{"city": "Par', None, "length"))
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(client, tools=[WEATHER], tool_choice=named).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": '{"city": "Par'}


def test_streamed_tool_calls(client, core) -> None:  # type: ignore[no-untyped-def]
    pieces = ["Sure", ". <tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>']
    core.script(*[Delta([i], t, None, "stop" if i == 3 else None) for i, t in enumerate(pieces)])
    r = chat(client, tools=[TIME], stream=True)
    deltas = [e["choices"][0] for e in events(r.text)[:-1]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert content == "Sure. "  # nothing of the call leaks into content
    last = deltas[-1]
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_time", "arguments": "{}"}


def test_history_with_tool_calls_goes_through_the_template(client, core, tool_tokenizer) -> None:  # type: ignore[no-untyped-def]
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    body = {"model": MODEL, "messages": messages, "tools": [TIME], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    prompt = tool_tokenizer.decode(core.calls[-1][1])
    assert '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' in prompt
    assert "12:00" in prompt


def test_tool_stream_holds_back_only_a_possible_tag() -> None:
    p = plan([TIME], "auto", None)
    assert p is not None
    s = ToolStream(p)
    assert s.feed("a <") == "a "  # "<" may begin <tool_call>
    assert s.feed("b") == "<b"  # it did not
    assert s.feed(" <tool_call>{bad json}</tool_call>") == " "
    rest, calls = s.finish()
    assert rest == "<tool_call>{bad json}</tool_call>" and calls == []  # not a call: content


# ---- best_of --------------------------------------------------------------------------------
def test_best_of_returns_the_n_most_likely_candidates(client, core) -> None:  # type: ignore[no-untyped-def]
    scores = {0: -3.0, 1: -0.5, 2: -1.0}  # candidate -> logprob of each of its two tokens
    core.script(
        *[
            Delta([10 * c + i], f"c{c}t{i}", [{10 * c + i: lp}], "length" if i else None, index=c)
            for i in range(2)
            for c, lp in scores.items()
        ]
    )
    r = completion(client, max_tokens=2, n=2, best_of=3)
    assert r.status_code == 200, r.text
    params = core.calls[-1][2]
    assert params.n == 3 and params.logprobs == 0  # three candidates, ranked by logprob
    body = r.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "c1t0c1t1"), (1, "c2t0c2t1")]
    assert all(c["logprobs"] is None for c in body["choices"])  # not asked for
    assert body["usage"]["completion_tokens"] == 6  # every candidate's tokens, as OpenAI counts


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"n": 3, "best_of": 2}, "between n (3)"),
        ({"best_of": 21}, "between n (1) and 20"),
        ({"best_of": 2, "stream": True}, "cannot be streamed"),
    ],
)
def test_bad_best_of_is_400(client, body, words) -> None:  # type: ignore[no-untyped-def]
    r = completion(client, **body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "best_of"
