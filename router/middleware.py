"""ASGI middleware for every route: the request id, and reading a bounded body.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and client
disconnects pass straight through.
"""

from __future__ import annotations

import re
import uuid

from router.errors import bad_request, body_too_large

_VALID_ID = re.compile(r"^[\x21-\x7e]{1,256}$")  # printable ASCII, no spaces: safe in logs


def request_id_from(header: str | None) -> str:
    """The client's id when it is safe to echo and to log, else a fresh one."""
    if header and _VALID_ID.match(header):
        return header
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Puts the id in `request.state.request_id`, and on the response when the client sent
    none. (Serve's proxy always forwards an `x-request-id`, the client's or its own, and
    echoes it on the response itself; adding it again would duplicate the header.)"""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1") or None
        request_id = request_id_from(given)
        scope.setdefault("state", {})["request_id"] = request_id
        if given is not None:
            return await self.app(scope, receive, send)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                raw = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": raw + [(b"x-request-id", request_id.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


async def read_json(request, max_bytes: int):
    """The JSON body, never more than `max_bytes` read (413), malformed -> 400."""
    import json

    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise body_too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except UnicodeDecodeError:
        raise bad_request("The body is not valid UTF-8") from None
    except ValueError as e:
        raise bad_request(f"The body is not valid JSON: {e}") from None
