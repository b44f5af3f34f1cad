"""Schemathesis against the OpenAI HTTP app: generated requests (valid ones, and ones that break
the schema) never get a 5xx, and every error is the OpenAI envelope {"error": {message, type,
param, code}}.

The app serves no OpenAPI document (`openapi_url=None`) and reads its JSON bodies itself, so the
schema here is FastAPI's description of the routes plus the request models' JSON schemas; the
`model` is steered to the served one and token ids into the vocabulary, so that valid requests
get past the first checks and reach the core.

The core is the scripted fake of test_app.py, which also encodes the control message the real
RouterCore would send for the request: a value the workers' msgpack wire cannot carry is then a
500 here, as it would be in production. Deterministic (`derandomize=True`, no example database);
every call has a timeout, so nothing can hang the test.
"""

from __future__ import annotations

import copy
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
import schemathesis
from fake_core import FakeCore
from hypothesis import HealthCheck, given, settings
from pydantic.json_schema import models_json_schema
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from pdserve.engine.request import SamplingParams
from pdserve.metrics import Metrics
from pdserve.router import protocol as p
from pdserve.router.app import create_app
from pdserve.router.core import Delta
from pdserve.router.errors import error_type
from pdserve.workers import messages as m

MODEL = "fake-model"
VALID_BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 2,
    },
}
MAX_LEN = 64
MAX_BODY = 4096
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 20}
CALL_TIMEOUT_S = 10.0

OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/v1/requests/{rid}/timeline"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/admin/workers"),
]
# Negative cases (bodies that break the schema) for the POSTs: a path parameter is any string.
CASES = [
    (method, path, mode)
    for method, path in OPERATIONS
    for mode in EXAMPLES
    if mode is GenerationMode.POSITIVE or method == "POST"
]


class WireCheckingCore(FakeCore):
    """The fake core, plus what the real one does with a request before any worker sees it:
    encode it as a control message (RouterCore._dispatch), for a worker whose sampler divides
    the logits by the temperature."""

    async def generate(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        session: str | None = None,
    ) -> AsyncIterator[Delta]:
        m.encode(m.Generate(rid, list(prompt_ids), dict(params.__dict__)))  # OverflowError?
        if not (math.isfinite(params.temperature) and math.isfinite(params.top_p)):
            raise AssertionError(f"non-finite sampling parameters reached the core: {params}")
        async for delta in super().generate(rid, prompt_ids, params):
            yield delta


def openapi_document(app: Any, vocab_size: int) -> dict[str, Any]:
    doc = copy.deepcopy(app.openapi())  # the routes; their bodies are read by hand, so:
    _, top = models_json_schema(
        [(p.CompletionRequest, "validation"), (p.ChatCompletionRequest, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(top["$defs"])
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        props = schemas[model]["properties"]
        props["model"] = {"type": "string", "enum": [MODEL]}
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}},
        }
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    schemas["CompletionRequest"]["properties"]["prompt"] = {
        "anyOf": [
            {"type": "string", "maxLength": 200},
            {"type": "array", "items": token, "maxItems": 40},
            {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            {"type": "array", "items": {"type": "array", "items": token}, "maxItems": 2},
        ]
    }
    for op in doc["paths"].values():  # no response checks: only "no 5xx" and the envelope
        for spec in op.values():
            spec["responses"] = {"default": {"description": "any"}}
    return doc


@pytest.fixture(scope="module")
def api(default_tokenizer: Any) -> Any:
    app = create_app(
        WireCheckingCore(),
        default_tokenizer,
        model_name=MODEL,
        max_model_len=MAX_LEN,  # also bounds what the fake core streams: no request runs long
        max_body_bytes=MAX_BODY,
        metrics=Metrics(slo_ttft_s=10.0, slo_tpot_s=0.1),
    )
    schema = schemathesis.openapi.from_dict(openapi_document(app, len(default_tokenizer)))
    schema.app = app
    return schema


def assert_error_envelope(response: Any) -> None:
    body = response.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    error = body["error"]
    assert isinstance(error.get("message"), str) and error["message"], body
    assert error.get("type") == error_type(response.status_code), body
    assert "param" in error and "code" in error, body


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=str)
def test_no_server_errors_and_openai_error_envelopes(
    api: Any, method: str, path: str, mode: GenerationMode
) -> None:
    statuses: list[int] = []

    @settings(
        max_examples=EXAMPLES[mode],
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=api[path][method].as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        response = case.call(timeout=CALL_TIMEOUT_S)
        case.validate_response(response, checks=[not_a_server_error])
        statuses.append(response.status_code)
        if response.status_code >= 400:
            assert_error_envelope(response)

    run()
    if method == "POST" and mode is GenerationMode.POSITIVE:
        # the steering works: a valid request through the same schema reaches the core. (Which
        # generated examples are valid varies with hypothesis' state across the whole session,
        # so the check does not depend on one of them being valid.)
        case = api[path][method].Case(body=VALID_BODIES[path])
        response = case.call(timeout=CALL_TIMEOUT_S)
        assert response.status_code == 200, response.text
