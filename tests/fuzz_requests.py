"""Hypothesis strategies for malformed OpenAI requests, as raw HTTP bodies and headers.

Every example is malformed by construction: wrong types, huge or negative numbers,
invalid UTF-8, oversized bodies, empty or broken message lists, unknown roles, broken
JSON, JSON that is not an object. A mutated JSON body that would still validate gets one
more mutation that surely does not (`temperature: "hot"`), so each example must be a 4xx.
"""

from __future__ import annotations

import json
import os

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from router.openai_protocol import ChatCompletionRequest, CompletionRequest

FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "seed", "stop", "stream", "stream_options", "n", "min_tokens", "stop_token_ids",
          "ignore_eos", "return_token_ids", "model", "logprobs", "echo", "suffix", "best_of"]
ROLES = ["user", "system", "assistant", "tool", "developer", "robot", "", "USER", 5, None]

numbers = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([-1, 0, 2**31, 2**63, -(2**63), 10**30]),
                    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1.5, -0.0, 1e308, -1e308]))
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=24))
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                    max_leaves=8)
message = st.fixed_dictionaries({"role": st.sampled_from(ROLES)},
                                optional={"content": junk, "name": junk, "extra": junk})
messages = st.one_of(st.just([]), st.lists(st.one_of(message, junk), min_size=1, max_size=4), junk)


def _valid(kind: str, body) -> bool:
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        model.model_validate(body)
        return True
    except (ValidationError, ValueError, TypeError):
        return False


@st.composite
def mutated_json(draw) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["completion", "chat"]))
    body = ({"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"})
    body["max_tokens"] = 1
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(FIELDS))
        if draw(st.booleans()) and field in body:
            del body[field]
        else:
            body[field] = draw(messages if field == "messages" else junk)
    if _valid(kind, body):
        body["temperature"] = "hot"
    return kind, json.dumps(body).encode()


broken_json = st.one_of(
    st.binary(max_size=64),
    st.just(b""), st.just(b"{"), st.just(b'{"prompt": "hi",}'), st.just(b"null"), st.just(b"[]"),
    st.just(b'"just a string"'), st.just(b"42"), st.just(b'{"prompt": NaN, "max_tokens": 1}'),
    st.builds(lambda s, cut: s[:cut], st.just(b'{"prompt": "hello", "max_tokens": 1}'), st.integers(0, 30)),
)
invalid_utf8 = st.builds(lambda bad: b'{"prompt": "' + bad + b'", "max_tokens": 1}',
                         st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf0\x28\x8c\x28", b"\x80abc"]))
oversized = st.builds(lambda n: json.dumps({"prompt": "a" * n, "max_tokens": 1}).encode(),
                      st.integers(70_000, 200_000))
raw_bodies = st.tuples(st.sampled_from(["completion", "chat"]), st.one_of(broken_json, invalid_utf8, oversized))
header_text = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.strip)
headers = st.fixed_dictionaries({}, optional={"x-pd-mode": header_text, "x-workload": header_text,
                                              "x-request-id": header_text})
requests = st.tuples(st.one_of(mutated_json(), raw_bodies), headers)


EXAMPLES = int(os.environ.get("PDC_FUZZ_EXAMPLES", "1000"))
SEEN: list[int] = []  # the status of every request `post_each` sent


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
          suppress_health_check=list(HealthCheck))
@given(example=requests)
def post_each(client: httpx.Client, key_headers: dict, example) -> None:
    """Post `EXAMPLES` malformed requests: each must get a 4xx (413 when oversized) with an
    OpenAI-shaped error body and no traceback."""
    (kind, content), headers = example
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    r = client.post(path, content=content, headers={**headers, **key_headers, "content-type": "application/json"})
    SEEN.append(r.status_code)
    assert 400 <= r.status_code < 500, (r.status_code, content[:200], r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in r.text
    if len(content) > 64 * 1024:
        assert r.status_code == 413
