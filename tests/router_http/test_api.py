"""The Router's HTTP API end to end: real Ray Serve, the real workers, real HTTP.

The package's app (1 prefill + 1 decode + 2 router replicas, tests/router_http/support.py)
serves completions and streaming, errors, the admin API, metrics and the worker stream
here; the OpenAI client's view of the API (test_openai.py) and the router's explanations
of its routes (test_policy.py) run on the same deployment. `/health` with pools that
never come up is tests/test_router_health_pools.py.
"""

from __future__ import annotations

import json
import time

import pytest

from router.metrics import METRIC_NAMES
from tests.router_http.support import (
    DEFAULT_MAX_TOKENS,
    MAX_TOKENS_LIMIT,
    TOKEN,
    assert_openai_error,
    complete,
    sum_by,
)
from workers.protocol import REASONS


def test_completion_headers_and_request_id(client):
    r = complete(client, headers={"x-request-id": "req-abc.1"}, return_token_ids=True)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "req-abc.1"
    assert r.headers["x-pd-route"] in ("local", "disagg")
    assert r.headers["x-pd-reason"] in REASONS
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].endswith("req-abc.1")
    assert body["usage"]["prompt_tokens"] == len(body["prompt_token_ids"]) == len("hello there")
    assert body["usage"]["completion_tokens"] == len(body["choices"][0]["token_ids"])
    generated = complete(client).headers["x-request-id"]
    assert generated and generated != "req-abc.1"


def test_greedy_tokens_identical_local_and_disagg(client):
    prompt = "the same long prompt " * 4
    outs = {}
    for mode in ("local", "disagg"):
        r = complete(client, prompt, headers={"x-pd-mode": mode}, max_tokens=6, return_token_ids=True)
        assert r.status_code == 200, r.text
        assert (r.headers["x-pd-route"], r.headers["x-pd-reason"]) == (mode, "forced")
        outs[mode] = r.json()["choices"][0]["token_ids"]
    assert outs["local"] == outs["disagg"]


def test_threshold_routes_by_prompt_length(client):
    short = complete(client, "hi")
    assert (short.headers["x-pd-route"], short.headers["x-pd-reason"]) == ("local", "short-prompt")
    long = complete(client, "a fresh long prompt that nobody sent before " * 2)
    assert (long.headers["x-pd-route"], long.headers["x-pd-reason"]) == ("disagg", "long-prompt")


def test_streaming_chat_with_usage(client):
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 5, "ignore_eos": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-pd-route"] in ("local", "disagg")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_streaming_completion_equals_non_streaming(client):
    body = {"prompt": "stream me", "temperature": 0, "max_tokens": 6, "ignore_eos": True,
            "return_token_ids": True}
    whole = client.post("/v1/completions", json=body).json()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]


def test_max_tokens_defaulted_and_over_the_limit_refused(client):
    default = complete(client, ignore_eos=True).json()
    assert default["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
    at_limit = complete(client, ignore_eos=True, max_tokens=MAX_TOKENS_LIMIT).json()
    assert at_limit["usage"]["completion_tokens"] == MAX_TOKENS_LIMIT
    over = complete(client, ignore_eos=True, max_tokens=MAX_TOKENS_LIMIT + 1)
    assert_openai_error(over, 400)
    error = over.json()["error"]
    assert error["param"] == "max_tokens" and str(MAX_TOKENS_LIMIT) in error["message"]


@pytest.mark.parametrize(
    ("path", "content", "status", "code"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"\xff\xfe", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", json.dumps({"prompt": 5}).encode(), 400, None),
        ("/v1/completions", json.dumps({"prompt": "x", "n": 0}).encode(), 400, None),
        ("/v1/completions", json.dumps({"prompt": [10**6]}).encode(), 400, None),
        ("/v1/completions", json.dumps({"prompt": "x", "model": "gpt-9"}).encode(), 404, "model_not_found"),
        ("/v1/completions", json.dumps({"prompt": "x" * 4200}).encode(), 400, "context_length_exceeded"),
        ("/v1/completions", json.dumps({"prompt": "x", "min_tokens": 5, "max_tokens": 2}).encode(), 400, None),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, None),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), 400, None),
        ("/v1/completions", b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}', 413, None),
    ],
)
def test_bad_requests_get_openai_errors(client, path, content, status, code):
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    assert_openai_error(r, status, code)
    assert r.headers.get("x-request-id")


def test_unknown_route_and_method(client):
    assert_openai_error(client.get("/v1/nothing"), 404)
    assert_openai_error(client.get("/v1/completions"), 405)
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_profile_controls_client_override(client):
    long = "x-pd-mode is ignored for locked workloads " * 2
    locked = complete(client, long, headers={"x-workload": "locked", "x-pd-mode": "disagg"})
    assert (locked.headers["x-pd-route"], locked.headers["x-pd-reason"]) == ("local", "profile")
    rag = complete(client, "hi", headers={"x-workload": "rag"})
    assert (rag.headers["x-pd-route"], rag.headers["x-pd-reason"]) == ("disagg", "profile")
    unknown = complete(client, "hi", headers={"x-workload": "no-such-workload", "x-pd-mode": "disagg"})
    assert unknown.headers["x-pd-reason"] == "forced"  # default profile allows the override


def test_admin_auth_and_toggle_reaches_every_router_within_2s(client):
    assert_openai_error(client.get("/admin/workloads"), 401)
    assert_openai_error(client.get("/admin/workloads", headers={"authorization": "Bearer nope"}), 401)
    auth = {"authorization": f"Bearer {TOKEN}"}
    listed = client.get("/admin/workloads", headers=auth).json()
    assert listed["workloads"]["rag"]["mode"] == "disagg"
    assert_openai_error(client.put("/admin/workloads/rag", json={"mode": "local"}, headers=auth), 400)
    profile = {"mode": "local", "min_remote_prefill_tokens": 1, "max_prefill_queue": 1,
               "allow_client_override": False, "slo": {"ttft_ms": 500.0, "tpot_ms": 50.0}}
    changed_at = time.monotonic()
    r = client.put("/admin/workloads/rag", json=profile, headers=auth)
    assert r.status_code == 200 and r.json()["version"] > listed["version"]
    time.sleep(max(0.0, 2.0 - (time.monotonic() - changed_at)))
    reasons = {(complete(client, "hi", headers={"x-workload": "rag"}).headers["x-pd-route"]) for _ in range(8)}
    assert reasons == {"local"}  # both router replicas apply it
    defaults = {"deadline_s": None, "max_local_prefill_tokens_while_decoding": 512}  # the optional fields
    assert client.get("/admin/workloads", headers=auth).json()["workloads"]["rag"] == {**profile, **defaults}


ADMIN = {"authorization": f"Bearer {TOKEN}"}
FULL_PROFILE = {"mode": "local", "min_remote_prefill_tokens": 1, "max_prefill_queue": 1,
                "allow_client_override": False}


def _workloads(client) -> dict:
    """GET /admin/workloads, checking its ETag names the version in the body."""
    r = client.get("/admin/workloads", headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.headers["etag"] == f'"{r.json()["version"]}"'
    return r.json()


def test_admin_put_if_match_stale_is_409_and_changes_nothing(client):
    before = _workloads(client)
    version = before["version"]
    stale = client.put("/admin/workloads/scratch", json=FULL_PROFILE, headers={**ADMIN, "if-match": str(version - 1)})
    assert_openai_error(stale, 409, "version_conflict")
    assert f"version is {version}" in stale.json()["error"]["message"]
    bad = client.put("/admin/workloads/scratch", json=FULL_PROFILE, headers={**ADMIN, "if-match": "v1"})
    assert_openai_error(bad, 400)
    assert bad.json()["error"]["param"] == "If-Match"
    assert _workloads(client) == before
    r = client.put("/admin/workloads/scratch", json=FULL_PROFILE, headers={**ADMIN, "if-match": f'"{version}"'})
    assert r.status_code == 200 and r.json()["version"] == version + 1, r.text
    assert r.headers["etag"] == f'"{version + 1}"'


def test_admin_delete_with_if_match_and_its_refusals(client):
    assert_openai_error(client.delete("/admin/workloads/scratch"), 401)
    version = client.put("/admin/workloads/scratch", json=FULL_PROFILE, headers=ADMIN).json()["version"]
    assert_openai_error(client.delete("/admin/workloads/scratch", headers={**ADMIN, "if-match": str(version - 1)}),
                        409, "version_conflict")
    r = client.delete("/admin/workloads/scratch", headers={**ADMIN, "if-match": str(version)})
    assert r.status_code == 200, r.text
    assert r.json() == {"name": "scratch", "deleted": True, "version": version + 1}
    assert r.headers["etag"] == f'"{version + 1}"'
    assert_openai_error(client.delete("/admin/workloads/scratch", headers=ADMIN), 404, "workload_not_found")
    refused = client.delete("/admin/workloads/default", headers=ADMIN)
    assert_openai_error(refused, 400)
    assert "always exists" in refused.json()["error"]["message"]
    listed = _workloads(client)
    assert "scratch" not in listed["workloads"] and listed["version"] == version + 1
    time.sleep(2.0)  # every router replica has polled the delete: `scratch` is the default profile now
    reasons = {complete(client, "hi", headers={"x-workload": "scratch", "x-pd-mode": "disagg"}).headers["x-pd-reason"]
               for _ in range(4)}
    assert reasons == {"forced"}  # `scratch` refused overrides; `default` allows them


def test_admin_restore_round_trip_keeps_an_operators_change_until_reread(client):
    original = _workloads(client)  # what a tool saved
    operators = {**original["workloads"]["locked"], "mode": "disagg", "max_prefill_queue": 3}
    assert client.put("/admin/workloads/locked", json=operators, headers=ADMIN).status_code == 200
    saved = original["workloads"]["locked"]
    stale = client.put("/admin/workloads/locked", json=saved, headers={**ADMIN, "if-match": str(original["version"])})
    assert_openai_error(stale, 409, "version_conflict")
    assert _workloads(client)["workloads"]["locked"]["mode"] == "disagg"  # the operator's change stands
    current = _workloads(client)["version"]
    r = client.put("/admin/workloads/locked", json=saved, headers={**ADMIN, "if-match": f'"{current}"'})
    assert r.status_code == 200, r.text
    restored = _workloads(client)
    assert restored["workloads"] == original["workloads"]
    assert restored["version"] > original["version"]


def test_metrics_show_every_name_after_traffic(client):
    complete(client, "metrics traffic prompt, long enough to go remote " * 2, headers={"x-pd-mode": "disagg"})
    for _ in range(2):  # the second one hits the prefix cache, whatever ran before this test
        complete(client, "a prompt for the prefix cache to remember " * 2, headers={"x-pd-mode": "local"})
    with client.stream("POST", "/v1/completions", json={"prompt": "s", "stream": True, "max_tokens": 3,
                                                        "ignore_eos": True}) as r:
        list(r.iter_lines())
    deadline = time.monotonic() + 10
    while True:
        text = client.get("/metrics").text
        samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("pdc_")}
        missing = [n for n in METRIC_NAMES if not any(s == n or s.startswith(n + "_") for s in samples)]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert not missing, f"missing from /metrics: {missing}"
    assert 'pool="decode"' in text and 'pool="prefill"' in text
    assert not any(s.startswith("pdc_") and s.split("_")[1] not in
                   ("time", "inter", "e2e", "route", "kv", "prefix", "num", "worker", "export", "prompt",
                    "prediction", "policy", "request", "requests", "engine") for s in samples)
    assert {"pdc_prediction_abs_pct_error_bucket", "pdc_policy_correction_factor",
            "pdc_engine_step_seconds_total"} <= samples, samples
    assert 'part="run_wait"' in text and 'part="cpu"' in text


def test_generate_travels_over_the_worker_stream(client):
    """Every call reaches its replica over the ZeroMQ worker stream, none through a Serve
    handle: the router found each replica's advertised stream address."""
    for mode in ("local", "disagg"):
        r = complete(client, "which path does this take " * 3, headers={"x-pd-mode": mode})
        assert r.status_code == 200 and r.headers["x-pd-route"] == mode
    deadline = time.monotonic() + 10  # routers push their counts every few s, workers every 0.5 s
    while True:
        text = client.get("/metrics").text
        calls, served = sum_by(text, "pdc_worker_calls_total", "path"), sum_by(
            text, "pdc_worker_stream_calls_total", "method")
        received = sum_by(text, "pdc_kv_received_bytes_total", "path")
        if (calls.get("stream", 0) >= 2 and served.get("prefill", 0) >= 1 and received) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert calls.get("stream", 0) >= 2 and calls.get("handle", 0) == 0, calls
    # the workers served them, and the decode replica called the prefill replica over it too
    assert served.get("generate", 0) >= 2 and served.get("prefill", 0) >= 1, served
    assert sum(received.values()) > 0, received  # and received the KV, by some data path
