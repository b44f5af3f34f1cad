"""OpenAI's error envelope: `{"error": {"message", "type", "param", "code"}}` for every error
the router answers (`error_body`; pydantic's validation errors through
`validation_error_body`), and `InvalidRequest`, the client mistake found after parsing."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

# The error `type` for each HTTP status (OpenAI's names where it has one).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class InvalidRequest(Exception):
    """A client mistake found after parsing: answered with `status` (400 unless said otherwise)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = "invalid_value",
        status: int = 400,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """The OpenAI error envelope as a plain dict: {"error": {message, type, param, code}}."""
    info = ErrorInfo(message=message, type=error_type(status), param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def validation_error_body(errors: list[Any]) -> dict[str, Any]:
    """A 400 envelope from pydantic/FastAPI validation errors: the first one, its field as param."""
    if not errors:
        return error_body(400, "invalid request", code="invalid_request")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if err.get("type") == "json_invalid":
        msg, param = f"request body is not valid JSON: {msg}", None
    elif err.get("type") == "missing":
        msg = f"missing required parameter {param!r}"
    elif param and err.get("type") != "value_error":
        msg = f"{param}: {msg}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return error_body(400, msg, param=param, code="invalid_value")
