"""Structured outputs, the request side: OpenAI's `response_format` and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` become one
`SamplingParams.structured_outputs` constraint (engine/grammar.py compiles it on the worker).

At most one source per request; a schema or regex the grammar library refuses is a 400 naming
the field it came from, before any worker sees the request.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.grammar import check_spec
from pdserve.router.errors import InvalidRequest

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def response_format_spec(value: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's response_format: text (no constraint), json_object, json_schema."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str):
            raise InvalidRequest(
                "response_format.json_schema must be an object with a 'name' (and a 'schema')",
                "response_format",
            )
        schema = js.get("schema")
        if schema is None:
            return {"json_object": True}  # a name without a schema: any JSON object
        return {"json": schema}
    raise InvalidRequest(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "response_format",
    )


def request_spec(fields: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The constraint of a request from its fields (name -> value, None when absent), and the
    field it came from; validated (compiled) here."""
    given = [name for name, v in fields.items() if v is not None]
    if len(given) > 1:
        raise InvalidRequest(
            f"give one way to constrain the output, not {' and '.join(given)}", given[1]
        )
    if not given:
        return None, None
    name = given[0]
    value = fields[name]
    if name == "response_format":
        spec = response_format_spec(value)
    elif name == "structured_outputs":
        spec = value
    else:
        spec = {GUIDED[name]: value}
    if spec is not None:
        try:
            check_spec(spec)
        except ValueError as e:
            message = str(e)
            if name != "structured_outputs":  # say it in the client's terms
                message = message.replace(f"structured_outputs.{next(iter(spec))}", name)
            raise InvalidRequest(message, name, "invalid_value") from None
    return spec, name
