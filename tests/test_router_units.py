"""Router units without Ray: request validation (with a fuzz), workload precedence,
replica pinning and API keys. (Placement and its prefix index: test_router_placement.py;
metrics merge, control plane and admin checks: test_control_plane.py; dispatch, SSE
framing and timing: test_router_streaming.py.)"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.config import WorkloadProfile
from router.errors import APIError
from router.ingress import _parse
from router.profiles import Profiles, client_mode

# ---- request validation ------------------------------------------------------------


def parse(kind, body):
    return _parse(kind, body)


def test_valid_requests():
    req = parse("completion", {"prompt": [1, 2, 3], "stop": "x", "stream": True,
                               "stream_options": {"include_usage": True}, "top_k": -1})
    assert req.include_usage and req.sampling_params(4).stop == ("x",)
    assert req.sampling_params(4).top_k == 0
    chat = parse("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                          "max_completion_tokens": 3, "return_token_ids": True, "ignore_eos": True})
    assert chat.max_tokens == 3 and chat.template_messages() == [{"role": "user", "content": "a"}]
    assert parse("completion", {"prompt": ["one"]}).prompts == ["one"]
    assert parse("completion", {"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]
    echo = parse("completion", {"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 0, "n": 2})
    params = echo.sampling_params(1)
    assert (params.logprobs, params.prompt_logprobs, params.n) == (1, 1, 2)
    chat = parse("chat", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 2,
                          "frequency_penalty": 0.5, "logit_bias": {"7": -100}, "user": "u", "metadata": {},
                          "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "o", "schema": {"type": "object"}}}})
    params = chat.sampling_params(4)
    assert (params.logprobs, params.frequency_penalty, params.logit_bias) == (2, 0.5, ((7, -100.0),))
    assert params.guided.kind == "json_schema" and json.loads(params.guided.spec) == {"type": "object"}


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("completion", {}, "prompt"),
        ("completion", {"prompt": ""}, "prompt"),
        ("completion", {"prompt": [-1]}, "prompt"),
        ("completion", {"prompt": ["a", ""]}, "prompt"),
        ("completion", {"prompt": "x", "n": 0}, "n"),
        ("completion", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("completion", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("completion", {"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
        ("completion", {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
        ("completion", {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ("chat", {"messages": [{"role": "user"}]}, "messages.0.content"),
        ("completion", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ("completion", {"prompt": "x", "temperature": -1}, "temperature"),
        ("completion", {"prompt": "x", "top_p": 0}, "top_p"),
        ("completion", {"prompt": "x", "seed": 2**70}, "seed"),
        ("completion", {"prompt": "x", "stream": "yes"}, "stream"),
        ("completion", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("completion", {"prompt": "x", "stop": [""]}, "stop"),
        ("completion", {"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
        ("chat", {"messages": "hi"}, "messages"),
    ],
)
def test_invalid_requests_are_400_naming_the_field(kind, body, param):
    with pytest.raises(APIError) as info:
        parse(kind, body)
    assert info.value.status == 400
    assert (info.value.param or "").startswith(param)
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**80, max_value=2**80)
    | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed",
                          "stop", "stream", "stream_options", "n", "min_tokens", "stop_token_ids",
                          "ignore_eos", "return_token_ids", "model", "logprobs", "echo", "best_of",
                          "frequency_penalty", "logit_bias", "response_format", "guided_choice",
                          "top_logprobs", "suffix", "tools"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["completion", "chat"]),
       body=st.dictionaries(fields, json_values, max_size=6) | json_values)
def test_fuzz_malformed_bodies_only_ever_4xx(kind, body):
    try:
        req = parse(kind, body)
    except APIError as e:
        assert 400 <= e.status < 500
        json.dumps(e.body())
        return
    # What validates must also make valid engine params.
    req.sampling_params(max(req.max_tokens or 1, req.min_tokens, 1))


# ---- workloads ---------------------------------------------------------------------


def test_profile_precedence():
    profiles = Profiles(1, {"default": WorkloadProfile(), "rag": WorkloadProfile(mode="disagg"),
                            "chat": WorkloadProfile(mode="local"), "m": WorkloadProfile()})
    assert profiles.resolve("rag", "chat", "m") == "rag"
    assert profiles.resolve(None, "chat", "m") == "chat"
    assert profiles.resolve(None, None, "m") == "m"
    assert profiles.resolve(None, None, None) == "default"
    assert profiles.resolve("unknown", "chat", "m") == "default"
    assert profiles.get("nope").mode == "auto"


def test_client_override_only_where_allowed():
    assert client_mode(WorkloadProfile(allow_client_override=True), "Disagg") == "disagg"
    assert client_mode(WorkloadProfile(allow_client_override=False), "disagg") is None
    assert client_mode(WorkloadProfile(), "sideways") is None
    assert client_mode(WorkloadProfile(), None) is None


# ---- replica pinning and API keys --------------------------------------------------


class _Replica:
    def __init__(self, unique_id):
        self.replica_id = type("RID", (), {"unique_id": unique_id})()


class _Pending:
    def __init__(self, target):
        self.args = [type("Req", (), {"target_replica": target})()]
        self.kwargs = {}


def test_target_replica_router_pins_or_falls_back():
    import asyncio

    from router.replica_router import TargetReplicaRouter

    replicas = [_Replica("a"), _Replica("b")]
    choose = TargetReplicaRouter.choose_replicas
    assert asyncio.run(choose(None, replicas, _Pending("b"))) == [[replicas[1]]]
    assert asyncio.run(choose(None, replicas, _Pending("gone"))) == [replicas]
    assert asyncio.run(choose(None, replicas, _Pending(None))) == [replicas]
    assert asyncio.run(choose(None, replicas, None)) == [replicas]


def test_api_keys_file(tmp_path):
    from router.api_keys import ApiKeys

    assert ApiKeys.load(None) is None
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  sk-a: {tenant: a, workload: rag}\n")
    keys = ApiKeys.load(path)
    assert keys.check("Bearer sk-a").workload == "rag"
    for header in (None, "Bearer sk-b", "sk-a"):
        with pytest.raises(APIError) as info:
            keys.check(header)
        assert info.value.status == 401
