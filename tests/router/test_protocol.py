"""OpenAI request/response models: defaults, refusals with the parameter named, logprob shapes."""

from __future__ import annotations

import json

import pytest

from pdserve.router import protocol as p
from pdserve.router import responses as r
from pdserve.router.errors import InvalidRequest, error_body, validation_error_body


def parse(cls, **body):  # type: ignore[no-untyped-def]
    return p.parse_request(cls, json.dumps(body).encode())


def refused(cls, **body) -> InvalidRequest:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequest) as e:
        parse(cls, **body).to_sampling_params(*(() if cls is p.CompletionRequest else (100,)))
    return e.value


def test_completion_defaults_and_noop_defaults_accepted() -> None:
    req = parse(
        p.CompletionRequest,
        model="m",
        prompt="hi",
        frequency_penalty=0,
        suffix=None,
        best_of=1,
        tools=[],
        response_format={"type": "text"},
    )
    sp = req.to_sampling_params()
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k) == (16, 1.0, 1.0, -1)
    assert sp.logprobs is None and sp.seed is None and not req.stream and not req.include_usage


def test_completion_prompt_forms() -> None:
    assert parse(p.CompletionRequest, model="m", prompt="a").prompt_input() == "a"
    assert parse(p.CompletionRequest, model="m", prompt=[1, 2]).prompt_input() == [1, 2]
    assert parse(p.CompletionRequest, model="m", prompt=["a"]).prompt_input() == "a"
    assert parse(p.CompletionRequest, model="m", prompt=[[5, 6]]).prompt_input() == [5, 6]
    e = refused(p.CompletionRequest, model="m", prompt=["a", "b"])
    assert e.param == "prompt" and "one prompt per request" in e.message


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"n": 0}, "n", "n must be between 1 and 128"),
        ({"echo": True}, "echo", "echo"),
        ({"logprobs": 6}, "logprobs", "less than or equal to 5"),
        ({"temperature": -1}, "temperature", "temperature must be >= 0"),
        ({"temperature": "hot"}, "temperature", "valid number"),
        ({"top_p": 0}, "top_p", "top_p"),
        ({"top_k": -5}, "top_k", "top_k"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"seed": 2**70}, "seed", "seed"),
    ],
)
def test_completion_refusals_name_the_param(body: dict, param: str, words: str) -> None:
    e = refused(p.CompletionRequest, model="m", prompt="hi", **body)
    assert (e.status, e.param) == (400, param)
    assert words in e.message


def test_missing_and_malformed() -> None:
    with pytest.raises(InvalidRequest, match="missing required parameter 'model'"):
        p.parse_request(p.CompletionRequest, b'{"prompt": "x"}')
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        p.parse_request(p.CompletionRequest, b'{"prompt": ')
    with pytest.raises(InvalidRequest, match="empty"):
        p.parse_request(p.CompletionRequest, b"")
    with pytest.raises(InvalidRequest):
        p.parse_request(p.CompletionRequest, b"[1, 2]")


def test_temperature_zero_and_tiny_are_greedy() -> None:
    for t in (0, 1e-9):
        sp = parse(p.CompletionRequest, model="m", prompt="x", temperature=t).to_sampling_params()
        assert sp.greedy and sp.temperature == 0


def test_completion_stop_and_extensions() -> None:
    req = parse(
        p.CompletionRequest,
        model="m",
        prompt="x",
        stop="\n",
        top_k=5,
        ignore_eos=True,
        seed=7,
        logprobs=2,
        max_tokens=50,
        stream=True,
        stream_options={"include_usage": True},
    )
    sp = req.to_sampling_params(p.Context(100, 50))
    assert sp.stop == ["\n"] and sp.top_k == 5 and sp.ignore_eos and sp.seed == 7
    assert sp.logprobs == 2 and sp.max_tokens == 50 and req.include_usage


def test_chat_params() -> None:
    req = parse(
        p.ChatCompletionRequest,
        model="m",
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        max_tokens=9,
        max_completion_tokens=5,
        logprobs=True,
        top_logprobs=3,
    )
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    sp = req.to_sampling_params(100)
    assert sp.max_tokens == 5 and sp.logprobs == 3  # max_completion_tokens wins
    req = parse(p.ChatCompletionRequest, model="m", messages=[{"role": "user", "content": "x"}])
    sp = req.to_sampling_params(77)
    assert sp.max_tokens == 77 and sp.logprobs is None


def test_chat_refusals() -> None:
    user = [{"role": "user", "content": "x"}]
    e = refused(p.ChatCompletionRequest, model="m", messages=[])
    assert e.param == "messages" and "empty" in e.message
    e = refused(p.ChatCompletionRequest, model="m", messages=user, top_logprobs=2)
    assert e.param == "top_logprobs"
    e = refused(p.ChatCompletionRequest, model="m", messages=user, max_completion_tokens=0)
    assert e.param == "max_completion_tokens"
    e = refused(p.ChatCompletionRequest, model="m", messages=user, n=200)
    assert e.param == "n"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    req = parse(p.ChatCompletionRequest, model="m", messages=image)
    with pytest.raises(InvalidRequest, match="image_url"):
        req.template_messages()


def test_logprob_shapes() -> None:
    steps = [{5: -0.1, 6: -2.0, 5_000: -3.0}, {7: -1.5, 8: -0.2}]
    text = {5: "He", 6: "Hi", 5_000: "Yo", 7: "llo", 8: "y"}.__getitem__
    c = r.completion_logprobs(steps, text, offset=3)
    assert c.tokens == ["He", "llo"] and c.token_logprobs == [-0.1, -1.5]
    assert c.top_logprobs == [{"He": -0.1, "Hi": -2.0, "Yo": -3.0}, {"llo": -1.5, "y": -0.2}]
    assert c.text_offset == [3, 5]
    chat = r.chat_logprobs(steps, text, top_n=2)
    assert chat.content is not None
    first, second = chat.content
    assert (first.token, first.logprob, first.bytes) == ("He", -0.1, list(b"He"))
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("He", -0.1), ("Hi", -2.0)]
    assert [t.token for t in second.top_logprobs] == ["y", "llo"]  # ranked, sampled included
    assert r.chat_logprobs(steps, text, top_n=0).content[0].top_logprobs == []  # type: ignore[index]


def test_error_envelope() -> None:
    body = error_body(429, "slow down", code="rate_limited")
    assert body == {
        "error": {
            "message": "slow down",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limited",
        }
    }
    assert error_body(500, "x")["error"]["type"] == "internal_error"
    assert error_body(502, "x")["error"]["type"] == "server_error"
    errors = [{"loc": ("body", "temperature"), "msg": "bad", "type": "float_parsing"}]
    assert validation_error_body(errors)["error"]["param"] == "temperature"


def test_response_models_dump_openai_shapes() -> None:
    usage = r.Usage.of(3, 4)
    resp = r.CompletionResponse(
        id="cmpl-1", model="m", choices=[r.CompletionChoice(text="x")], usage=usage
    )
    d = resp.model_dump()
    assert d["object"] == "text_completion" and d["usage"]["total_tokens"] == 7
    chunk = r.ChatCompletionChunk(
        id="chatcmpl-1", model="m", choices=[r.ChatChunkChoice(delta=r.ChatDelta(content="y"))]
    )
    assert chunk.model_dump()["object"] == "chat.completion.chunk"
    assert r.ModelList(data=[r.ModelCard(id="m")]).model_dump()["data"][0]["object"] == "model"


def test_max_tokens_beyond_the_context_is_openais_400() -> None:
    req = parse(p.CompletionRequest, model="m", prompt="x", max_tokens=10**12)
    with pytest.raises(InvalidRequest) as e:
        req.to_sampling_params(p.Context(2048, 48))
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    assert e.value.message == (
        "This model's maximum context length is 2048 tokens, however you requested "
        f"{10**12 + 48} tokens (48 in your prompt; {10**12} for the completion). "
        "Please reduce your prompt; or completion length."
    )
    user = [{"role": "user", "content": "x"}]
    for field in ("max_tokens", "max_completion_tokens"):
        req = parse(p.ChatCompletionRequest, model="m", messages=user, **{field: 2001})
        with pytest.raises(InvalidRequest) as e:
            req.to_sampling_params(2000, p.Context(2048, 48))
        assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")
        assert e.value.message == (
            "This model's maximum context length is 2048 tokens. However, you requested "
            "2049 tokens (48 in the messages, 2001 in the completion). "
            "Please reduce the length of the messages or completion."
        )
        ok = parse(p.ChatCompletionRequest, model="m", messages=user, **{field: 2000})
        assert ok.to_sampling_params(2000, p.Context(2048, 48)).max_tokens == 2000


@pytest.mark.parametrize(
    ("body", "param", "code", "words"),
    [
        ({"frobnicate": 1}, "frobnicate", "unknown_parameter", "Unrecognized request argument"),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter", "not supported"),
        ({"function_call": "auto"}, "function_call", None, "not supported"),
        ({"audio": {"voice": "x"}}, "audio", None, "not supported"),
        ({"store": True}, "store", None, "not supported"),
        ({"stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats", None, ""),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value", "at most 4"),
        ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value", "between -2 and 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "invalid_value", "between -2 and 2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value", "> 0"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_value", "[-100, 100]"),
        ({"logit_bias": {"five": 1}}, "logit_bias", "invalid_value", "token ids"),
    ],
)
def test_unsupported_and_unknown_fields_are_named(
    body: dict, param: str, code: str | None, words: str
) -> None:
    user = [{"role": "user", "content": "x"}]
    e = refused(p.ChatCompletionRequest, model="m", messages=user, **body)
    assert (e.status, e.param) == (400, param)
    assert code is None or e.code == code
    assert words in e.message


def test_history_as_the_openai_client_sends_it_back() -> None:
    msgs = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y", "refusal": None, "tool_calls": None},
    ]
    assert parse(p.ChatCompletionRequest, model="m", messages=msgs).template_messages()[1] == {
        "role": "assistant",
        "content": "y",
    }
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    msgs[1]["tool_calls"] = [call]  # type: ignore[list-item]
    msgs.append({"role": "tool", "tool_call_id": "c", "content": "42"})
    out = parse(p.ChatCompletionRequest, model="m", messages=msgs).template_messages()
    # templates take the arguments as an object; the tool's answer keeps its call id
    assert out[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert out[2] == {"role": "tool", "content": "42", "tool_call_id": "c"}


@pytest.mark.parametrize("function", ["f", [1], 3])
def test_a_tool_call_whose_function_is_no_object_is_a_400(function: object) -> None:
    msgs = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": function}]},
    ]
    req = parse(p.ChatCompletionRequest, model="m", messages=msgs)
    with pytest.raises(InvalidRequest, match="function must be an object") as e:
        req.template_messages()
    assert (e.value.status, e.value.param) == (400, "messages")


def test_tools_stay_refused_on_completions() -> None:
    e = refused(p.CompletionRequest, model="m", prompt="x", tools=[{"type": "function"}])
    assert (e.param, e.code) == ("tools", "unsupported_parameter")


def test_penalties_and_bias_reach_the_sampling_params() -> None:
    req = parse(
        p.CompletionRequest,
        model="m",
        prompt="x",
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.3,
        logit_bias={"17": -100, "3": 2.5},
        stop=["a", "b", "c", "d"],
    )
    sp = req.to_sampling_params()
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.25, 1.3)
    assert sp.logit_bias == {17: -100, 3: 2.5} and len(sp.stop or ()) == 4


def test_a_chat_conversation_is_its_user_else_the_hash_of_its_opening_messages() -> None:
    def chat(*messages: tuple[str, str], user: str | None = None) -> p.ChatCompletionRequest:
        body = {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
        return p.ChatCompletionRequest.model_validate({**body, **({"user": user} if user else {})})

    turn1 = chat(("system", "be brief"), ("user", "hi"))
    turn2 = chat(("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "more"))
    assert turn1.conversation() == turn2.conversation()
    assert turn1.conversation().startswith("messages-")
    assert chat(("system", "be brief"), ("user", "bye")).conversation() != turn1.conversation()
    assert chat(("user", "hi"), user="u1").conversation() == "u1"
