"""Which OpenAI request fields the router honours, accepts, or refuses.

A client must never get an answer to a different question than it asked: a field that
would change the output and that this server does not honour is a 400 naming it, unless
it carries its no-op value (`tools: []`, `tool_choice: "none"`, ...). Fields that do not
change the output are accepted and ignored. Honoured fields are declared on the request
models (router/openai_protocol.py).

Fields in neither list and not declared there are not part of OpenAI's API (other
servers' extensions, typos); they are ignored, as OpenAI-compatible servers do, except
the common sampling extensions below, which would change the output.
"""

from __future__ import annotations

from typing import Any

from router.errors import APIError, bad_request


def _absent(value: Any) -> bool:
    return value is None or value == [] or value == {} or value is False


def _absent_or(*allowed: Any):
    return lambda value: _absent(value) or value in allowed


# field -> "this value changes nothing": anything else is refused.
_REFUSED_BOTH: dict[str, Any] = {
    # Extensions of other servers that would change the output.
    "min_p": _absent_or(0, 0.0),
    "use_beam_search": _absent,
    "length_penalty": _absent_or(1, 1.0),
    "guided_grammar": _absent,
    "structured_outputs": _absent,
    "truncate_prompt_tokens": _absent,
}
REFUSED: dict[str, dict[str, Any]] = {
    "completion": {**_REFUSED_BOTH, "suffix": _absent_or("")},
    "chat": {
        **_REFUSED_BOTH,
        "tools": _absent,
        "tool_choice": _absent_or("none"),
        "functions": _absent,
        "function_call": _absent_or("none"),
        "audio": _absent,
        "modalities": _absent_or(["text"]),
        "prediction": _absent,
        "reasoning_effort": _absent,
        "verbosity": _absent,
        "web_search_options": _absent,
        "echo": _absent,  # another server's extension (echo the last message), not honoured
    },
}

# Accepted and ignored: they do not change the output. (`parallel_tool_calls` only matters
# with `tools`, which are refused.)
ACCEPTED: dict[str, frozenset[str]] = {
    "completion": frozenset({"user"}),
    "chat": frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                       "prompt_cache_key", "safety_identifier"}),
}


def refused_field(kind: str, body: dict[str, Any]) -> APIError | None:
    """The 400 for the first field of `body` that this server would silently not honour."""
    for name, harmless in REFUSED[kind].items():
        if name in body and not harmless(body[name]):
            return bad_request(f"{name}: is not supported by this server", param=name,
                               code="unsupported_parameter")
    return None
