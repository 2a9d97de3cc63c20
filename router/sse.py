"""Server-sent-event framing for OpenAI streams.

A stream is `data: {chunk}` events, optionally one usage-only chunk, then
`data: [DONE]`. An error after the stream started (headers already sent) is one
`data: {"error": {...}}` event followed by `data: [DONE]`.
"""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_events(error_body: dict[str, Any]) -> str:
    """The two events that end a stream that failed after it started."""
    return event(error_body) + DONE


def usage_chunk(base: dict[str, Any], num_prompt_tokens: int, num_completion_tokens: int) -> str:
    """The final `stream_options.include_usage` chunk: no choices, just usage."""
    return event({**base, "choices": [], "usage": usage(num_prompt_tokens, num_completion_tokens)})


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
