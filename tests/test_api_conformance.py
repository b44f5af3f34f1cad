"""The official `openai` client against `pdserve serve` on three routes: colocated, 1P1D
remote (every request through P) and 1P1D conditional (an idle cluster prefills short prompts
locally on D): the same request gives the same output on each (greedy, seeded, penalized,
biased, n > 1, structured outputs, tools), and the strict limits answer the same 400s.

The model is the tiny Llama with a chat template that knows tools (conftest TOOL_TEMPLATE)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest

from pdserve.costmodel.model import CostModel
from test_serve import Server

# roughly the tiny model on one thread (as in test_scheduling_e2e): an idle cluster predicts a
# local prefill on D faster than a transfer for short prompts
TINY_COST = CostModel((0.002, 2e-5, 0.0), (0.002, 1e-4, 0.0), (0.0005, 1e9))


@pytest.fixture(scope="module")
def routes(tiny_tool_llama_path):  # type: ignore[no-untyped-def]
    path = str(tiny_tool_llama_path)
    cost = Path(tempfile.mkdtemp(prefix="pdserve-conformance-")) / "cost.json"
    TINY_COST.save(cost)
    servers = {
        "1p1d": Server(path),  # 1 prefill + 1 decode worker, every request through P
        "colocated": Server(path, "--colocated", "1"),
        "local": Server(path, "--disaggregation", "conditional", "--cost-model", str(cost)),
    }
    yield servers
    for srv in servers.values():
        srv.stop()


def _workers_of(srv: Server, rid: str) -> set[str]:
    """The workers that took part in a request (its timeline)."""
    body = httpx.get(f"{srv.url}/v1/requests/{rid}/timeline", timeout=10).json()
    return {e["worker"] for e in body["events"] if e.get("worker")}


def _all(routes: dict[str, Server], **kw: Any) -> dict[str, Any]:
    out = {}
    for name, srv in routes.items():
        client = srv.client()
        model = client.models.list().data[0].id
        out[name] = client.completions.create(model=model, prompt="The quick brown fox", **kw)
    return out


CASES = [
    {"temperature": 0},
    {"temperature": 1.0, "seed": 1234},
    {"temperature": 0.8, "top_p": 0.9, "seed": 7, "frequency_penalty": 1.0},
    {
        "temperature": 0,
        "presence_penalty": 1.5,
        "extra_body": {"repetition_penalty": 1.3},
        "logit_bias": {"300": 5},
    },
]


@pytest.mark.parametrize("case", CASES)
def test_the_same_output_on_every_route(routes, case) -> None:  # type: ignore[no-untyped-def]
    got = _all(routes, max_tokens=10, **case)
    texts = {name: r.choices[0].text for name, r in got.items()}
    assert len(set(texts.values())) == 1, texts


def test_n_choices_on_every_route_equal_seed_plus_i(routes) -> None:  # type: ignore[no-untyped-def]
    eos = {"extra_body": {"ignore_eos": True}}
    got = _all(routes, max_tokens=8, n=3, temperature=1.0, seed=99, **eos)
    one = _all(routes, max_tokens=8, temperature=1.0, seed=99, **eos)["colocated"]
    for r in got.values():
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert r.usage.prompt_tokens == one.usage.prompt_tokens  # counted once, not n times
        assert r.usage.completion_tokens == 3 * 8
    for name in ("1p1d", "local"):
        assert [c.text for c in got[name].choices] == [c.text for c in got["colocated"].choices]
    assert len({c.text for c in got["colocated"].choices}) > 1
    for i in range(3):
        alone = _all(routes, max_tokens=8, temperature=1.0, seed=99 + i, **eos)["colocated"]
        assert alone.choices[0].text == got["colocated"].choices[i].text


def test_streamed_choices_carry_their_index(routes) -> None:  # type: ignore[no-untyped-def]
    for srv in routes.values():
        client = srv.client()
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            max_tokens=5,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text = {0: "", 1: ""}
        usage = None
        for chunk in stream:
            for ch in chunk.choices:
                text[ch.index] += ch.delta.content or ""
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == 2 * 5
        assert all(text.values())


def test_strict_limits_on_a_real_server(routes) -> None:  # type: ignore[no-untyped-def]
    client = routes["1p1d"].client()
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=10**12)
    assert e.value.code == "context_length_exceeded"  # type: ignore[attr-defined]
    assert "maximum context length" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument"):
        client.completions.create(model=model, prompt="x", extra_body={"guided_frob": {}})
    with pytest.raises(openai.BadRequestError, match="at most 4"):
        client.completions.create(model=model, prompt="x", stop=["a", "b", "c", "d", "e"])


# ---- structured outputs -------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
# one call at most: a random model under an unbounded array may list calls until max_tokens
FORCED = {
    "max_tokens": 80,
    "temperature": 0,
    "tools": [WEATHER, TIME],
    "parallel_tool_calls": False,
}
USER = [{"role": "user", "content": "Tell me about a user."}]


def _chats(routes: dict[str, Server], **kw: Any) -> dict[str, Any]:
    out = {}
    for name, srv in routes.items():
        client = srv.client()
        model = client.models.list().data[0].id
        out[name] = client.chat.completions.create(model=model, messages=USER, **kw)
    return out


def test_json_schema_on_every_route_validates_and_is_identical(routes) -> None:  # type: ignore[no-untyped-def]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    got = _chats(routes, max_tokens=80, temperature=0, response_format=fmt)
    texts = {name: r.choices[0].message.content for name, r in got.items()}
    assert len(set(texts.values())) == 1, texts
    validator = jsonschema_rs.validator_for(PERSON)
    for r in got.values():
        assert r.choices[0].finish_reason == "stop"
        assert validator.is_valid(json.loads(r.choices[0].message.content))
    assert "P0" not in _workers_of(routes["local"], got["local"].id)  # prefilled on D
    assert "P0" in _workers_of(routes["1p1d"], got["1p1d"].id)  # P sampled the first token
    # the grammar state crossed P -> D (seeded sampling, n = 2 forked on D)
    sampled = _chats(routes, max_tokens=80, temperature=1.0, seed=5, n=2, response_format=fmt)
    for r in sampled.values():
        for c in r.choices:
            assert c.finish_reason == "stop" and validator.is_valid(json.loads(c.message.content))
    contents = {n: [c.message.content for c in r.choices] for n, r in sampled.items()}
    assert len({tuple(v) for v in contents.values()}) == 1, contents


def _object_or_its_prefix(text: str, finish: str) -> bool:
    if finish == "stop":
        return isinstance(json.loads(text), dict)
    return text.startswith("{")


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t, f: len(t) == 6 and t[3] == "-"),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t, f: t in ("red", "green", "blue")),
        # any object: the random model may go on adding keys until max_tokens
        ({"response_format": {"type": "json_object"}}, _object_or_its_prefix),
    ],
)
def test_guided_completions_on_every_route(routes, extra, check) -> None:  # type: ignore[no-untyped-def]
    got = _all(routes, max_tokens=60, temperature=0, extra_body=extra)
    texts = {name: r.choices[0].text for name, r in got.items()}
    assert len(set(texts.values())) == 1, texts
    for r in got.values():
        finish = r.choices[0].finish_reason
        assert finish in ("stop", "length") and check(r.choices[0].text, finish)
        assert finish == "stop" or "json_object" in str(extra)


def test_truncated_structured_output_says_length(routes) -> None:  # type: ignore[no-untyped-def]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    full = _chats(routes, max_tokens=80, temperature=0, response_format=fmt)["colocated"]
    cut = _chats(routes, max_tokens=4, temperature=0, response_format=fmt)
    for r in cut.values():
        assert r.choices[0].finish_reason == "length"
        assert full.choices[0].message.content.startswith(r.choices[0].message.content)


def test_invalid_schema_is_a_400_on_a_real_server(routes) -> None:  # type: ignore[no-untyped-def]
    client = routes["1p1d"].client()
    model = client.models.list().data[0].id
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=USER, response_format=bad)
    assert e.value.param == "response_format"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        client.completions.create(model=model, prompt="x", extra_body={"guided_regex": "(["})


# ---- tools --------------------------------------------------------------------------------------
def _calls(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
)
def test_forced_tool_calls_on_every_route(routes, choice) -> None:  # type: ignore[no-untyped-def]
    got = _chats(routes, tool_choice=choice, **FORCED)
    calls = {name: _calls(r.choices[0].message) for name, r in got.items()}
    assert len({json.dumps(v) for v in calls.values()}) == 1, calls
    for r in got.values():
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        for name, args in _calls(r.choices[0].message):
            assert name in ("get_weather", "get_time") and isinstance(args, dict)
            if name == "get_weather":
                assert jsonschema_rs.validator_for(WEATHER["function"]["parameters"]).is_valid(args)  # type: ignore[index]
    if isinstance(choice, dict):
        assert [n for n, _ in calls["colocated"]] == ["get_weather"]
    # streamed: the same calls, each whole in the choice's last chunk
    for srv in routes.values():
        client = srv.client()
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model, messages=USER, tool_choice=choice, stream=True, **FORCED
        )
        streamed, finish = [], None
        for chunk in stream:
            for ch in chunk.choices:
                streamed += [
                    (c.function.name, json.loads(c.function.arguments))
                    for c in ch.delta.tool_calls or ()
                ]
                finish = ch.finish_reason or finish
        assert streamed == calls["colocated"] and finish == "tool_calls"


def test_auto_and_none_on_every_route(routes) -> None:  # type: ignore[no-untyped-def]
    """The tiny random model rarely writes a <tool_call> block by itself: `auto` must give the
    same message on every route, with tool_calls only if it did; `none` never has tool_calls."""
    got = _chats(routes, max_tokens=30, temperature=0, tools=[WEATHER], tool_choice="auto")
    msgs = {n: (r.choices[0].message.content, _calls(r.choices[0].message)) for n, r in got.items()}
    assert len({json.dumps(v) for v in msgs.values()}) == 1, msgs
    none = _chats(routes, max_tokens=10, temperature=0, tools=[WEATHER], tool_choice="none")
    for r in none.values():
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"
