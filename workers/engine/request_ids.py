"""Engine request ids and the ids they came with.

A client may reuse an `x-request-id` and a retry reuses it too, so an engine names each
request `<the id it came with>#<a process-wide counter>`. A heartbeat reports the
prompts still prefilling by their engine id; a router reads back the id it sent with
`origin_request_id`.
"""

from __future__ import annotations

import itertools

SEPARATOR = "#"
_nonce = itertools.count()


def engine_request_id(request_id: str) -> str:
    """An engine-unique id for a request that came with `request_id`."""
    return f"{request_id}{SEPARATOR}{next(_nonce)}"


def origin_request_id(engine_id: str) -> str:
    """The id the request came with (an id without a counter is its own origin)."""
    head, sep, tail = engine_id.rpartition(SEPARATOR)
    return head if sep and tail.isdigit() else engine_id
