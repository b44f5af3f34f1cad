"""OpenAI request/response models: defaults, refusals with the parameter named, logprob shapes."""

from __future__ import annotations

import json

import pytest

from pdserve.router import protocol as p


def parse(cls, **body):  # type: ignore[no-untyped-def]
    return p.parse_request(cls, json.dumps(body).encode())


def refused(cls, **body) -> p.InvalidRequest:  # type: ignore[no-untyped-def]
    with pytest.raises(p.InvalidRequest) as e:
        parse(cls, **body).to_sampling_params(*(() if cls is p.CompletionRequest else (100,)))
    return e.value


def test_completion_defaults_and_unknown_fields_ignored() -> None:
    req = parse(p.CompletionRequest, model="m", prompt="hi", frequency_penalty=0, suffix=None)
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
        ({"n": 2}, "n", "n must be 1"),
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
    with pytest.raises(p.InvalidRequest, match="missing required parameter 'model'"):
        p.parse_request(p.CompletionRequest, b'{"prompt": "x"}')
    with pytest.raises(p.InvalidRequest, match="not valid JSON"):
        p.parse_request(p.CompletionRequest, b'{"prompt": ')
    with pytest.raises(p.InvalidRequest, match="empty"):
        p.parse_request(p.CompletionRequest, b"")
    with pytest.raises(p.InvalidRequest):
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
    sp = req.to_sampling_params(max_tokens_cap=20)
    assert sp.stop == ["\n"] and sp.top_k == 5 and sp.ignore_eos and sp.seed == 7
    assert sp.logprobs == 2 and sp.max_tokens == 20 and req.include_usage


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
    e = refused(p.ChatCompletionRequest, model="m", messages=user, n=3)
    assert e.param == "n"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    req = parse(p.ChatCompletionRequest, model="m", messages=image)
    with pytest.raises(p.InvalidRequest, match="image_url"):
        req.template_messages()


def test_logprob_shapes() -> None:
    steps = [{5: -0.1, 6: -2.0, 5_000: -3.0}, {7: -1.5, 8: -0.2}]
    text = {5: "He", 6: "Hi", 5_000: "Yo", 7: "llo", 8: "y"}.__getitem__
    c = p.completion_logprobs(steps, text, offset=3)
    assert c.tokens == ["He", "llo"] and c.token_logprobs == [-0.1, -1.5]
    assert c.top_logprobs == [{"He": -0.1, "Hi": -2.0, "Yo": -3.0}, {"llo": -1.5, "y": -0.2}]
    assert c.text_offset == [3, 5]
    chat = p.chat_logprobs(steps, text, top_n=2)
    assert chat.content is not None
    first, second = chat.content
    assert (first.token, first.logprob, first.bytes) == ("He", -0.1, list(b"He"))
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("He", -0.1), ("Hi", -2.0)]
    assert [t.token for t in second.top_logprobs] == ["y", "llo"]  # ranked, sampled included
    assert p.chat_logprobs(steps, text, top_n=0).content[0].top_logprobs == []  # type: ignore[index]


def test_error_envelope() -> None:
    body = p.error_body(429, "slow down", code="rate_limited")
    assert body == {
        "error": {
            "message": "slow down",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limited",
        }
    }
    assert p.error_body(500, "x")["error"]["type"] == "internal_error"
    assert p.error_body(502, "x")["error"]["type"] == "server_error"
    errors = [{"loc": ("body", "temperature"), "msg": "bad", "type": "float_parsing"}]
    assert p.validation_error_body(errors)["error"]["param"] == "temperature"


def test_response_models_dump_openai_shapes() -> None:
    usage = p.Usage.of(3, 4)
    r = p.CompletionResponse(
        id="cmpl-1", model="m", choices=[p.CompletionChoice(text="x")], usage=usage
    )
    d = r.model_dump()
    assert d["object"] == "text_completion" and d["usage"]["total_tokens"] == 7
    chunk = p.ChatCompletionChunk(
        id="chatcmpl-1", model="m", choices=[p.ChatChunkChoice(delta=p.ChatDelta(content="y"))]
    )
    assert chunk.model_dump()["object"] == "chat.completion.chunk"
    assert p.ModelList(data=[p.ModelCard(id="m")]).model_dump()["data"][0]["object"] == "model"
