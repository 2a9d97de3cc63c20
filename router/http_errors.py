"""The FastAPI handlers that answer every error OpenAI-shaped (router/errors.py).

A bug is logged server side and answered as a 500 without a stack trace; Starlette's own
404/405 and FastAPI's validation errors get the same body as every other error.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.errors import APIError, from_validation_error

logger = logging.getLogger("pdcluster.router")


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error's status and OpenAI body, with its own headers and then `headers`."""
    return JSONResponse(error.body(), status_code=error.status, headers={**error.headers, **(headers or {})})


def install_handlers(app: FastAPI) -> None:
    """Every error `app` raises, answered OpenAI-shaped."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, _request_id_header(request))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(from_validation_error(exc), _request_id_header(request))  # type: ignore[arg-type]


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    messages = {404: f"Unknown route {request.method} {request.url.path}",
                405: f"Method {request.method} is not allowed on {request.url.path}"}
    status = exc.status_code if exc.status_code >= 400 else 400
    if status >= 500 and status != 503:
        status = 500
    message = messages.get(status, str(exc.detail))
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return error_response(APIError(status, message, code=code), _request_id_header(request))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    request_id = getattr(request.state, "request_id", None)
    logger.error("request %s failed: %r", request_id, exc, exc_info=exc)
    return error_response(APIError(500, "Internal server error", code="internal_error"),
                          _request_id_header(request))


def _request_id_header(request: Request) -> dict[str, str]:
    return {}  # RequestIdMiddleware (or Serve's proxy) sets x-request-id on every response
