"""OpenAI-shaped errors: `APIError` and the constructors for each kind.

Every error the HTTP API returns has the body
`{"error": {"message", "type", "param", "code"}}`. Bad input is always a 4xx (never
FastAPI's 422); the only 5xx are 503 (nothing can serve) and 500 for a bug. This module
is plain Python (placement raises from it outside any web server); router/http_errors.py
turns these into FastAPI responses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

if TYPE_CHECKING:
    from fastapi.exceptions import RequestValidationError

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
    429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client as-is (status, OpenAI body, extra headers)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    @classmethod
    def from_body(cls, status: int, body: dict[str, Any]) -> APIError:
        err = body.get("error", body) if isinstance(body, dict) else {}
        return cls(status, str(err.get("message", "error")), param=err.get("param"),
                   code=err.get("code"), type_=err.get("type"))


class RequestTimedOut(APIError):
    """An APIError that ends a request because a time limit expired: its workload's
    `deadline_s` (the worker's `deadline_exceeded`) or no first chunk within
    `router.request_timeout_s`. Answered like any APIError; the router counts it."""


class FieldError(ValueError):
    """A request model's check across fields, naming the field the client should change.

    `param` is relative to the model that raises it: a nested model's location is prefixed
    by pydantic (a check in `response_format` names `json_schema`, the client sees
    `response_format.json_schema`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")


def context_length_exceeded(prompt_len: int, max_len: int) -> APIError:
    return APIError(400, f"This model's maximum context length is {max_len} tokens; the prompt "
                    f"has {prompt_len} tokens and at least one more is needed to generate",
                    param="prompt", code="context_length_exceeded")


def max_tokens_over_limit(param: str, wanted: int, limit: int) -> APIError:
    return APIError(400, f"{param}: {wanted} is more than this server's limit of {limit} tokens "
                    "(limits.max_tokens_limit)", param=param, code="invalid_value")


def max_tokens_over_context(param: str, wanted: int, prompt_len: int, max_len: int) -> APIError:
    return APIError(400, f"This model's maximum context length is {max_len} tokens; you requested "
                    f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} in {param}). "
                    f"Reduce the prompt or {param}", param=param, code="context_length_exceeded")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit} bytes", code="request_too_large")


def unavailable(message: str = "No replica can serve this request now") -> APIError:
    return APIError(503, message, code="service_unavailable")


def from_validation_error(error: ValidationError | RequestValidationError) -> APIError:
    """The first problem, with its location as `param` (e.g. `messages.0.role`)."""
    items = error.errors()
    if not items:
        return bad_request("Invalid request")
    first = items[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):  # a check across fields names the one to change
        loc.append(cause.param)
    # Drop pydantic's union-branch labels (`str`, `list[int]`) from the parameter path.
    param = ".".join(p for p in loc if not _is_type_label(p)) or None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return bad_request(f"{param}: {message}" if param else message, param=param)


def _is_type_label(part: str) -> bool:
    return any(ch in part for ch in "[]()") or part in ("str", "int", "float", "bool", "list", "dict")
