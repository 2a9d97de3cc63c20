"""OpenAI-shaped errors and the FastAPI handlers that guarantee them.

Every error the HTTP API returns has the body
`{"error": {"message", "type", "param", "code"}}`. Bad input is always a 4xx (never
FastAPI's 422); the only 5xx are 503 (nothing can serve) and 500 for a bug, which is
logged server side and answered without a stack trace.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("pdcluster.router")

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

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**self.headers, **(headers or {})})

    @classmethod
    def from_body(cls, status: int, body: dict[str, Any]) -> APIError:
        err = body.get("error", body) if isinstance(body, dict) else {}
        return cls(status, str(err.get("message", "error")), param=err.get("param"),
                   code=err.get("code"), type_=err.get("type"))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")


def context_length_exceeded(prompt_len: int, max_len: int) -> APIError:
    return APIError(400, f"This model's maximum context length is {max_len} tokens; the prompt "
                    f"has {prompt_len} tokens and at least one more is needed to generate",
                    param="prompt", code="context_length_exceeded")


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
    # Drop pydantic's union-branch labels (`str`, `list[int]`) from the parameter path.
    param = ".".join(p for p in loc if not _is_type_label(p)) or None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return bad_request(f"{param}: {message}" if param else message, param=param)


def _is_type_label(part: str) -> bool:
    return any(ch in part for ch in "[]()") or part in ("str", "int", "float", "bool", "list", "dict")


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response(_request_id_header(request))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    return from_validation_error(exc).response(_request_id_header(request))  # type: ignore[arg-type]


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    messages = {404: f"Unknown route {request.method} {request.url.path}",
                405: f"Method {request.method} is not allowed on {request.url.path}"}
    status = exc.status_code if exc.status_code >= 400 else 400
    if status >= 500 and status != 503:
        status = 500
    message = messages.get(status, str(exc.detail))
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return APIError(status, message, code=code).response(_request_id_header(request))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    request_id = getattr(request.state, "request_id", None)
    logger.error("request %s failed: %r", request_id, exc, exc_info=exc)
    return APIError(500, "Internal server error", code="internal_error").response(_request_id_header(request))


def _request_id_header(request: Request) -> dict[str, str]:
    return {}  # RequestIdMiddleware (or Serve's proxy) sets x-request-id on every response
