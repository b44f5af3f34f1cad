"""The OpenAI HTTP app over a scripted fake core: shapes, streaming, every error, metrics, aborts.

Most tests drive the ASGI app in-process (Starlette's TestClient); the official `openai` client
and the client-disconnect tests talk to a real uvicorn server on a free port.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from fake_core import FakeCore, FakeFlight
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from factories import serving
from pdserve.metrics import Metrics
from pdserve.router.app import create_app
from pdserve.router.core import Delta, RequestError

MODEL = "fake-model"
KEY = "sk-test"
MAX_LEN = 64


@pytest.fixture
def core() -> FakeCore:
    return FakeCore()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(slo_ttft_s=10.0, slo_tpot_s=0.0)  # every multi-token request misses TPOT


@pytest.fixture
def client(core: FakeCore, metrics: Metrics, default_tokenizer: Any) -> TestClient:
    app = create_app(
        core,
        default_tokenizer,
        model_name=MODEL,
        max_model_len=MAX_LEN,
        max_body_bytes=4096,
        metrics=metrics,
    )
    return TestClient(app, raise_server_exceptions=False)


def events(text: str) -> list[Any]:
    """The SSE data payloads of a stream, JSON-decoded ("[DONE]" kept as the string)."""
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def completion(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world", **body})


def chat(client: TestClient, **body: Any) -> Any:
    messages = [{"role": "user", "content": "Hi there"}]
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **body})


# ---- completions and chat --------------------------------------------------------------------
def test_completion(client: TestClient, core: FakeCore, default_tokenizer: Any) -> None:
    r = completion(client, max_tokens=3, temperature=0, stop="\n", top_k=4, user="u1")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice == {"index": 0, "text": " w0 w1 w2", "finish_reason": "length", "logprobs": None}
    n_prompt = len(default_tokenizer.encode("Hello world"))
    assert body["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 3,
        "total_tokens": n_prompt + 3,
    }
    rid, ids, params = core.calls[-1]
    assert rid == body["id"] and ids == default_tokenizer.encode("Hello world")
    assert params.max_tokens == 3 and params.greedy and params.stop == ["\n"]
    assert params.top_k == 4
    assert core.outcomes[rid] == "ok"


def test_completion_token_prompt_and_context_cap(client: TestClient, core: FakeCore) -> None:
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": [[5, 6, 7]], "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    assert core.calls[-1][1] == [5, 6, 7]
    calls = len(core.calls)
    err = assert_error(completion(client, max_tokens=10**12), 400, param="prompt")
    assert err["code"] == "context_length_exceeded" and "however you requested" in err["message"]
    assert len(core.calls) == calls  # refused, never clamped and run
    r = chat(client, max_completion_tokens=MAX_LEN)
    assert_error(r, 400, param="messages", code="context_length_exceeded")


def test_completion_stream_with_usage(client: TestClient, core: FakeCore) -> None:
    r = completion(client, max_tokens=3, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    assert evs[-1] == "[DONE]"
    chunks, usage = evs[:-2], evs[-2]
    assert [c["choices"][0]["text"] for c in chunks] == [" w0", " w1", " w2"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert {c["id"] for c in chunks} == {usage["id"]} == {core.last_rid()}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_completion_stream_without_usage(client: TestClient) -> None:
    evs = events(completion(client, max_tokens=2, stream=True).text)
    assert len(evs) == 3 and evs[-1] == "[DONE]"
    assert all("usage" not in e for e in evs[:-1])


def test_chat(client: TestClient, core: FakeCore, default_tokenizer: Any) -> None:
    r = chat(client, max_completion_tokens=2, seed=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": " w0 w1"}
    assert choice["finish_reason"] == "length"
    text = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    expected = default_tokenizer.encode(text, add_special_tokens=False)
    rid, ids, params = core.calls[-1]
    assert rid == body["id"] and ids == expected and params.seed == 3
    assert body["usage"]["prompt_tokens"] == len(expected)


def test_chat_default_max_tokens_fills_the_context(client: TestClient, core: FakeCore) -> None:
    core.script(Delta([9], "ok", None, "stop"))
    assert chat(client).status_code == 200
    _, ids, params = core.calls[-1]
    assert params.max_tokens == MAX_LEN - len(ids)


def test_chat_stream(client: TestClient, core: FakeCore) -> None:
    r = chat(client, max_tokens=2, stream=True, stream_options={"include_usage": True})
    evs = events(r.text)
    assert evs[-1] == "[DONE]" and evs[-2]["usage"]["completion_tokens"] == 2
    first, *rest = evs[:-2]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in rest] == [" w0", " w1"]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"


def test_logprobs_shapes(client: TestClient) -> None:
    body = completion(client, max_tokens=2, logprobs=2).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 2
    assert lp["token_logprobs"] == [-0.25, -0.25]
    assert all(len(top) == 3 for top in lp["top_logprobs"])  # sampled + top 2
    assert lp["text_offset"][0] == 0
    body = chat(client, max_tokens=2, logprobs=True, top_logprobs=2).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert content[0]["logprob"] == -0.25 and len(content[0]["top_logprobs"]) == 2
    assert content[0]["top_logprobs"][0]["logprob"] == -0.25  # ranked: the sampled one is best
    evs = events(chat(client, max_tokens=2, logprobs=True, stream=True).text)
    assert evs[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


# ---- errors ------------------------------------------------------------------------------------
def assert_error(r: Any, status: int, *, param: Any = ..., code: Any = ...) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not ...:
        assert err["param"] == param
    if code is not ...:
        assert err["code"] == code
    return err  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": 0}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 10**9]}, "prompt"),
        ({"echo": True}, "echo"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"logprobs": 9}, "logprobs"),
        ({"logit_bias": {"10000000": 1}}, "logit_bias"),
        ({"frobnicate": True}, "frobnicate"),
    ],
)
def test_400_bad_params(client: TestClient, core: FakeCore, body: dict, param: str) -> None:
    err = assert_error(completion(client, **body), 400, param=param)
    assert err["type"] == "invalid_request_error"
    assert not core.calls  # refused before the core


def test_n_choices_whole_and_streamed(client: TestClient, core: FakeCore) -> None:
    r = completion(client, n=3, max_tokens=2, logprobs=1)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [" w0 w1", " c1w0 c1w1", " c2w0 c2w1"]
    offsets = body["choices"][2]["logprobs"]["text_offset"]
    assert len(offsets) == 2 and offsets[0] == 0  # each choice counts its own text
    prompt_tokens = len(core.calls[-1][1])
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,  # once, not n times
        "completion_tokens": 6,
        "total_tokens": prompt_tokens + 6,
    }
    assert core.calls[-1][2].n == 3
    r = chat(client, n=2, max_tokens=2, stream=True, stream_options={"include_usage": True})
    chunks = events(r.text)[:-1]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and "role" in str(c)]
    assert roles[:2] == [0, 1]
    text = {0: "", 1: ""}
    for c in chunks:
        for ch in c["choices"]:
            text[ch["index"]] += ch["delta"].get("content") or ""
    assert text == {0: " w0 w1", 1: " c1w0 c1w1"}
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    whole = chat(client, n=2, max_tokens=1).json()
    assert [c["message"]["content"] for c in whole["choices"]] == [" w0", " c1w0"]


def test_400_messages(client: TestClient) -> None:
    assert_error(chat(client, n=0), 400, param="n")
    assert "n must be between 1 and 128" in chat(client, n=129).json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert_error(r, 400, param="messages")
    r = client.post("/v1/completions", content=b'{"model": ', headers={"content-type": "x"})
    assert_error(r, 400)
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert_error(r, 400, param="model")


def test_400_too_long(client: TestClient) -> None:
    err = assert_error(
        completion(client, prompt="word " * 100), 400, code="context_length_exceeded"
    )
    assert str(MAX_LEN) in err["message"]
    big = [{"role": "user", "content": "word " * 100}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": big})
    assert_error(r, 400, code="context_length_exceeded")


def test_404_405(client: TestClient) -> None:
    assert_error(completion(client, model="gpt-4"), 404, param="model", code="model_not_found")
    assert_error(chat(client, model="gpt-4"), 404, code="model_not_found")
    assert_error(client.get("/v1/nope"), 404, code="not_found")
    assert_error(client.post("/v2/completions", json={}), 404)
    assert_error(client.get("/v1/completions"), 405)
    assert_error(client.get(f"/v1/models/{MODEL}x"), 404)


def test_413(client: TestClient) -> None:
    err = assert_error(completion(client, prompt="x" * 5000), 413, code="request_too_large")
    assert "4096" in err["message"]
    chunked = iter([b'{"model": "fake-model", "prompt": "', b"x" * 5000, b'"}'])
    r = client.post(
        "/v1/completions", content=chunked, headers={"content-type": "application/json"}
    )
    assert_error(r, 413)


def test_429_and_503_from_the_core(client: TestClient, core: FakeCore) -> None:
    core.script(RequestError("too many requests queued", 429, "rate_limited"))
    assert_error(completion(client), 429, code="rate_limited")
    core.script(RequestError("too many requests queued", 429, "rate_limited"))
    r = completion(client, stream=True)  # nothing streamed yet: a plain HTTP error
    err = assert_error(r, 429, code="rate_limited")
    assert err["type"] == "rate_limit_error"
    core.script(RequestError("no healthy workers", 503, "unavailable"))
    assert_error(chat(client), 503, code="unavailable")


def test_error_mid_stream_is_an_sse_event(client: TestClient, core: FakeCore) -> None:
    core.script(Delta([1], "a"), RequestError("decode worker lost", 503, "worker_error"))
    r = completion(client, stream=True)
    assert r.status_code == 200
    evs = events(r.text)
    assert evs[0]["choices"][0]["text"] == "a"
    assert evs[1]["error"]["code"] == "worker_error" and evs[1]["error"]["message"]
    assert evs[2] == "[DONE]" and len(evs) == 3
    assert core.outcomes[core.last_rid()] == "error"


def test_a_bug_is_a_500_envelope(client: TestClient, core: FakeCore) -> None:
    core.script(RuntimeError("boom"))
    assert_error(completion(client), 500, code="internal_error")
    core.script(Delta([1], "a"), RuntimeError("boom"))
    evs = events(chat(client, stream=True).text)
    assert evs[-2]["error"]["type"] == "internal_error" and evs[-1] == "[DONE]"


def test_401(core: FakeCore, default_tokenizer: Any) -> None:
    app = create_app(core, default_tokenizer, model_name=MODEL, api_key=KEY)
    c = TestClient(app)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert_error(c.post("/v1/completions", json=body), 401, code="invalid_api_key")
    bad = {"Authorization": "Bearer nope"}
    assert_error(c.post("/v1/completions", json=body, headers=bad), 401)
    assert_error(c.get("/admin/workers"), 401)
    assert_error(c.get("/v1/models", headers={"Authorization": KEY}), 401)  # no "Bearer"
    good = {"Authorization": f"Bearer {KEY}"}
    assert c.post("/v1/completions", json=body, headers=good).status_code == 200
    assert c.get("/v1/models", headers=good).status_code == 200
    assert c.get("/health").status_code == 200
    assert c.get("/metrics").status_code == 200


# ---- models, health, admin, timeline, metrics --------------------------------------------------
def test_models(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == MAX_LEN
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


def test_health(client: TestClient, core: FakeCore) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    core.rows[1]["healthy"] = False  # no healthy decode worker: P serves whole requests
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "degraded"
    core.rows[0]["healthy"] = False  # none at all
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_workers"
    core.rows = [dict(core.rows[0], role="colocated", healthy=True)]
    assert client.get("/health").status_code == 200


def test_admin_workers(client: TestClient) -> None:
    rows = client.get("/admin/workers").json()
    assert [r["role"] for r in rows] == ["prefill", "decode"]
    keys = {"id", "role", "url", "pid", "healthy", "queue", "running", "outstanding"}
    assert all(keys | {"kv_blocks_used", "kv_blocks_total"} == set(r) for r in rows)


def test_timeline(client: TestClient) -> None:
    rid = completion(client, max_tokens=2).json()["id"]
    r = client.get(f"/v1/requests/{rid}/timeline")
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == rid
    names = [e["event"] for e in body["events"]]
    assert names[0] == "arrive" and names[-1] == "finish" and "first_token" in names
    assert_error(client.get("/v1/requests/cmpl-nope/timeline"), 404, code="not_found")


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics(client: TestClient, core: FakeCore, metrics: Metrics) -> None:
    assert core.metrics is metrics  # create_app attached it
    before = samples(client.get("/metrics").text)
    assert before[("pdserve_requests_total", (("outcome", "ok"),))] == 0
    completion(client, max_tokens=4, stream=True)
    completion(client, temperature=-1)  # rejected
    core.script(Delta([1], "a"), 0.02, Delta([2], "b"), RequestError("lost", 503, "worker_error"))
    completion(client, stream=True)  # error
    core.emit_worker_stats()
    core.emit_transfer(nbytes=1000)
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = samples(r.text)
    assert s[("pdserve_requests_total", (("outcome", "ok"),))] == 1
    assert s[("pdserve_requests_total", (("outcome", "rejected"),))] == 1
    assert s[("pdserve_requests_total", (("outcome", "error"),))] == 1
    assert s[("pdserve_request_rejections_total", (("code", "invalid_value"),))] == 1
    assert s[("pdserve_generation_tokens_total", ())] == 6
    assert s[("pdserve_prompt_tokens_total", ())] > 0
    assert s[("pdserve_request_ttft_seconds_count", ())] == 2
    assert s[("pdserve_request_e2e_seconds_count", ())] == 1
    assert s[("pdserve_request_tpot_seconds_count", ())] == 1
    assert s[("pdserve_request_itl_seconds_count", ())] == 3 + 1  # gaps: 3 in ok, 1 in error
    assert s[("pdserve_request_itl_seconds_sum", ())] >= 0.02
    assert s[("pdserve_slo_violations_total", (("kind", "tpot"),))] == 1
    assert s[("pdserve_slo_violations_total", (("kind", "ttft"),))] == 0
    assert s[("pdserve_kv_transfer_bytes_total", (("side", "send"),))] == 1000
    assert s[("pdserve_kv_transfer_seconds_count", (("side", "recv"),))] == 1
    assert s[("pdserve_retries_total", ())] == 1
    assert s[("pdserve_recomputes_total", ())] == 0
    p0 = (("role", "prefill"), ("worker", "P0"))
    assert s[("pdserve_worker_queue_length", p0)] == 2
    assert s[("pdserve_worker_running", p0)] == 3
    assert s[("pdserve_worker_kv_blocks_used", p0)] == 10
    assert s[("pdserve_worker_kv_blocks_total", p0)] == 64
    assert s[("pdserve_worker_prefix_cache_hit_rate", p0)] == 0.5
    assert s[("pdserve_worker_handoffs_total", (("direction", "sent"), *p0))] == 4
    assert s[("pdserve_worker_preemptions_total", p0)] == 1
    assert s[("pdserve_worker_gc_collections_total", p0)] == 12
    assert s[("pdserve_worker_gc_full_collections_total", p0)] == 1
    assert s[("pdserve_worker_gc_pause_seconds_total", p0)] == 0.25
    assert s[("pdserve_worker_gc_max_pause_seconds", p0)] == 0.2
    assert s[("pdserve_worker_gc_frozen_objects", p0)] == 800_000
    d0 = (("role", "decode"), ("worker", "D0"))
    assert s[("pdserve_spec_draft_tokens_total", d0)] == 40
    assert s[("pdserve_spec_accepted_tokens_total", d0)] == 25
    assert s[("pdserve_spec_steps_total", d0)] == 10
    at2 = (("position", "2"), ("role", "decode"), ("worker", "D0"))
    assert s[("pdserve_spec_accepted_at_position_total", at2)] == 7
    assert s[("pdserve_spec_disabled_steps_total", p0)] == 0
    assert ("pdserve_kv_transfer_failures_total", p0) in s
    assert all(name.startswith("pdserve_") for name, _ in s)


def test_metrics_itl_is_the_real_gap() -> None:
    mx = Metrics(slo_ttft_s=0.5, slo_tpot_s=0.1)
    for i, t in enumerate((10.0, 10.1, 10.4)):  # gaps 0.1 and 0.3
        mx.on_delta("r", 1 + i, t)
    flight = FakeFlight("r", [1, 2, 3], sent=[1, 2, 3, 4, 5, 6])
    flight.timeline.append(("arrive", "router", 9.0))
    mx.on_request_end(flight, "ok")
    s = samples(mx.render().decode())
    assert s[("pdserve_request_itl_seconds_count", ())] == 2
    assert s[("pdserve_request_itl_seconds_sum", ())] == pytest.approx(0.4)
    assert s[("pdserve_request_ttft_seconds_sum", ())] == pytest.approx(1.0)
    assert s[("pdserve_request_tpot_seconds_sum", ())] == pytest.approx(0.4 / 5)
    assert s[("pdserve_slo_violations_total", (("kind", "ttft"),))] == 1
    assert s[("pdserve_slo_violations_total", (("kind", "tpot"),))] == 0
    assert not mx._streams  # forgotten at the end


# ---- a real server: the openai client, client disconnects --------------------------------------
@dataclass
class Server:
    url: str
    core: FakeCore


@pytest.fixture(scope="module")
def server(default_tokenizer: Any) -> Iterator[Server]:
    core = FakeCore()
    app = create_app(core, default_tokenizer, model_name=MODEL, api_key=KEY, metrics=Metrics())
    with serving(app, timeout_graceful_shutdown=1) as url:
        yield Server(url, core)


@pytest.fixture
def oai(server: Server) -> openai.OpenAI:
    server.core.scripts.clear()
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=10)


def test_openai_completions(oai: openai.OpenAI, server: Server) -> None:
    out = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=1)
    assert out.choices[0].text == " w0 w1 w2" and out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 3
    assert out.choices[0].logprobs is not None
    assert out.choices[0].logprobs.token_logprobs == [-0.25] * 3
    assert out.id == server.core.last_rid()
    stream = oai.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " w0 w1 w2"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 3


def test_openai_chat(oai: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Hi"}]
    out = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, logprobs=True, top_logprobs=1
    )
    msg = out.choices[0]
    assert msg.message.role == "assistant" and msg.message.content == " w0 w1"
    assert msg.logprobs is not None and msg.logprobs.content is not None
    assert [len(t.top_logprobs) for t in msg.logprobs.content] == [1, 1]
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " w0 w1"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    assert [m.id for m in oai.models.list().data] == [MODEL]


def test_openai_errors(oai: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="n must be between"):
        oai.completions.create(model=MODEL, prompt="x", n=0)
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument") as bad:
        oai.completions.create(model=MODEL, prompt="x", extra_body={"frobnicate": 1})
    assert bad.value.param == "frobnicate"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError, match="response_format is invalid") as bad:
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        )
    assert bad.value.param == "response_format"  # type: ignore[attr-defined]
    n3 = oai.completions.create(model=MODEL, prompt="x", n=3, max_tokens=2)
    assert [c.index for c in n3.choices] == [0, 1, 2] and n3.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert bad.value.param == "temperature"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="x")
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    server.core.script(RequestError("queue full", 429, "rate_limited"))
    with pytest.raises(openai.RateLimitError):
        oai.completions.create(model=MODEL, prompt="x")
    server.core.script(Delta([1], "a"), RequestError("decode worker lost", 503, "worker_error"))
    stream = oai.completions.create(model=MODEL, prompt="x", stream=True)
    with pytest.raises(openai.APIError, match="decode worker lost"):
        list(stream)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_the_request(server: Server, stream: bool) -> None:
    core = server.core
    core.started.clear()
    core.script(Delta([1], "a"), 30.0, Delta([2], "b", None, "stop"))
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "x", "stream": stream}
    with httpx.Client(base_url=server.url, headers=headers, timeout=5) as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                first = next(r.iter_lines())
                assert json.loads(first[len("data: ") :])["choices"][0]["text"] == "a"
        else:  # the client gives up waiting for the whole answer
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3))
    assert core.started.wait(1)
    rid = core.last_rid()
    t0 = time.monotonic()
    assert core.ended[rid].wait(1.0), "the core's generator was not closed within 1 s"
    assert core.outcomes[rid] == "aborted"
    assert time.monotonic() - t0 < 1.0


def test_disconnect_between_chunks(server: Server) -> None:
    core = server.core
    steps: list[Any] = []
    for i in range(200):
        steps += [Delta([i], f"t{i}"), 0.01]
    core.script(*steps)
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "x", "stream": True}
    with (
        httpx.Client(base_url=server.url, headers=headers, timeout=5) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        next(lines)
        next(lines)
    rid = core.last_rid()
    assert core.ended[rid].wait(1.0)
    assert core.outcomes[rid] == "aborted" and len(core.calls) > 0


# ---- fuzzing (issue 7): values the workers' wire or sampler cannot take are 400s, not 500s --
@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ('"temperature": NaN', "temperature"),  # passed SamplingParams, then killed the sampler
        ('"temperature": Infinity', "temperature"),
        ('"temperature": 1e999', "temperature"),  # JSON's overflow is infinity too
        ('"top_p": -Infinity', "top_p"),
    ],
)
def test_non_finite_sampling_floats_are_400(
    client: TestClient, core: FakeCore, raw: str, param: str
) -> None:
    body = f'{{"model": "{MODEL}", "prompt": "Hello", {raw}}}'
    r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not core.calls


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_k": 2**64}, "top_k"),  # msgpack's range: the router's send raised OverflowError
        ({"stop_token_ids": [1, 2**64]}, "stop_token_ids.1"),
        ({"stop_token_ids": [-(2**63) - 1]}, "stop_token_ids.0"),
        ({"max_tokens": 2**64}, "max_tokens"),
    ],
)
def test_ints_beyond_the_worker_wire_are_400(
    client: TestClient, core: FakeCore, body: dict, param: str
) -> None:
    r = completion(client, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert chat(client, **body).status_code == 400
    assert chat(client, max_completion_tokens=2**64).json()["error"]["param"] == (
        "max_completion_tokens"
    )
    assert not core.calls
    ok = completion(client, top_k=2**64 - 1, stop_token_ids=[-(2**63), 2**64 - 1], max_tokens=2)
    assert ok.status_code == 200, ok.text
    (_, _, params) = core.calls[-1]
    assert params.top_k == 2**64 - 1  # the edges still fit a control message


def test_role_endpoint_switches_and_refuses_bad_input(client: TestClient, core: FakeCore) -> None:
    worker = core.rows[0]["id"]
    r = client.post(f"/admin/workers/{worker}/role", json={"role": "decode"})
    assert r.status_code == 200 and r.json()["role"] == "decode"
    assert core.role_switches == [(worker, "decode", "admin")]
    bad = client.post(f"/admin/workers/{worker}/role", json={"role": "boss"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "role"
    missing = client.post("/admin/workers/nope/role", json={"role": "prefill"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_conversation_followups_are_counted_by_outcome_on_metrics() -> None:
    mx = Metrics()
    mx.on_conversation("hit")
    mx.on_conversation("miss")
    text = mx.render().decode()
    assert 'pdserve_conversation_followups_total{outcome="miss"} 1.0' in text
    assert 'pdserve_conversation_followups_total{outcome="hit"} 1.0' in text
    assert 'pdserve_conversation_followups_total{outcome="moved"} 0.0' in text
