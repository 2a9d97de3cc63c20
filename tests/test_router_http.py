"""The Router's HTTP API end to end: real Ray Serve, the real workers, real HTTP.

One app (1 prefill + 1 decode + 2 router replicas) serves most tests; two small apps
whose worker pools are pinned to a Ray resource no node has show `/health` degraded
(prefill pool never comes up) and 503 (nothing can serve).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from router.metrics import METRIC_NAMES
from workers.protocol import REASONS

APP = "pdc-router-http"
TOKEN = "admin-secret-token"
NOWHERE = {"resources": {"pdc_test_no_such_node": 1.0}}
DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT = 4, 96  # a bounded JSON object needs a few dozen tokens


def _config(model_dir, token_file, **overrides):
    config = {
        "model": {"path": str(model_dir)},
        "engine": {"num_kv_blocks": 512, "max_num_seqs": 16},
        "transport": {"host": "127.0.0.1"},
        "router": {"num_replicas": 2, "num_cpus": 0},
        "secrets": {"admin_token_file": str(token_file)},
        "limits": {"default_max_tokens": DEFAULT_MAX_TOKENS, "max_tokens_limit": MAX_TOKENS_LIMIT},
        "workloads": {
            "default": {"mode": "threshold", "min_remote_prefill_tokens": 32},
            "locked": {"mode": "local", "allow_client_override": False},
            "rag": {"mode": "disagg"},
        },
    }
    config.update(overrides)
    return config


def _wait_health(client, ok, timeout_s=120.0, times=1):
    """`times` answers in a row: with two router replicas, one replica's view may lag."""
    deadline, streak = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        try:
            r = client.get("/health")
            streak = streak + 1 if ok(r) else 0
            if streak >= times:
                return r
        except httpx.HTTPError:
            streak = 0
        time.sleep(0.3)
    raise AssertionError(f"/health never reached the expected state: {r.status_code} {r.text}")


@pytest.fixture(scope="module")
def client(ray_cluster, tiny_model_dir, tmp_path_factory):
    from ray import serve

    from cluster.app import build_app

    token_file = tmp_path_factory.mktemp("secrets") / "admin"
    token_file.write_text(TOKEN)
    serve.run(build_app(_config(tiny_model_dir, token_file)), name=APP, route_prefix="/")
    with httpx.Client(base_url=f"http://127.0.0.1:{ray_cluster['http_port']}", timeout=60) as c:
        _wait_health(c, lambda r: r.status_code == 200 and r.json()["status"] == "ok", times=6)
        yield c
    serve.delete(APP)


def complete(client, prompt="hello there", headers=None, **body):
    body = {"prompt": prompt, "temperature": 0, **body}
    return client.post("/v1/completions", json=body, headers=headers or {})


def assert_openai_error(r, status, code=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    if code is not None:
        assert error["code"] == code


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
        calls, served = _sum_by(text, "pdc_worker_calls_total", "path"), _sum_by(
            text, "pdc_worker_stream_calls_total", "method")
        received = _sum_by(text, "pdc_kv_received_bytes_total", "path")
        if (calls.get("stream", 0) >= 2 and served.get("prefill", 0) >= 1 and received) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert calls.get("stream", 0) >= 2 and calls.get("handle", 0) == 0, calls
    # the workers served them, and the decode replica called the prefill replica over it too
    assert served.get("generate", 0) >= 2 and served.get("prefill", 0) >= 1, served
    assert sum(received.values()) > 0, received  # and received the KV, by some data path


def _sum_by(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            value = line.split(f'{label}="')[1].split('"')[0]
            out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# ---- the OpenAI API through the official client -----------------------------------------


@pytest.fixture(scope="module")
def oai(client):
    import openai

    with openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _bad_request(call, param):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.body
    assert error["param"] == param and param in error["message"], error
    return error


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("field", "value"), [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]), ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {"voice": "x", "format": "wav"}),
    ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "high")])
def test_chat_fields_that_would_change_the_output_are_refused(oai, field, value):
    _bad_request(lambda: oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                                     extra_body={field: value}), field)


def test_completion_suffix_refused_and_harmless_fields_accepted(oai):
    _bad_request(lambda: oai.completions.create(model="tiny", prompt="x", suffix="y", max_tokens=1), "suffix")
    out = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, user="u", metadata={"a": "b"},
                                      store=False, tool_choice="none", parallel_tool_calls=False)
    assert len(out.choices) == 1


def test_limits_and_missing_content_are_400s(oai):
    over = MAX_TOKENS_LIMIT + 1
    _bad_request(lambda: oai.completions.create(model="tiny", prompt="x", max_tokens=over), "max_tokens")
    _bad_request(lambda: oai.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=over),
                 "max_completion_tokens")
    error = _bad_request(lambda: oai.chat.completions.create(model="tiny", messages=[{"role": "user"}]),
                         "messages.0.content")
    assert error["type"] == "invalid_request_error"


def test_tokenize_detokenize_round_trip(client):
    tokens = client.post("/tokenize", json={"model": "tiny", "prompt": "héllo"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len("héllo".encode()) and tokens["max_model_len"] > 0
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    with_prompt = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1,
                                                            "return_token_ids": True}).json()
    assert chat["tokens"] == with_prompt["prompt_token_ids"]
    assert_openai_error(client.post("/detokenize", json={"tokens": [10**7]}), 400)
    assert_openai_error(client.post("/tokenize", json={"prompt": "x", "messages": CHAT}), 400)


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_prompt_lists_give_one_choice_per_prompt_in_order(oai, mode):
    prompts = ["first prompt, long enough to go anywhere " * 2, "second " * 9, "a third one " * 6]
    one_by_one = [oai.completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0,
                                         extra_headers={"x-pd-mode": mode}).choices[0].text for p in prompts]
    batch = oai.completions.create(model="tiny", prompt=prompts, max_tokens=3, temperature=0,
                                   extra_headers={"x-pd-mode": mode})
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == one_by_one
    by_ids = oai.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0,
                                    extra_headers={"x-pd-mode": mode})
    assert len(by_ids.choices) == 2 and by_ids.usage.prompt_tokens == 5


def _transformers_logprobs(model_dir, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_echo_with_logprobs_as_lm_eval_reads_it(oai, tiny_model_dir, mode):
    """lm-eval's local-completions: token-id prompts, echo, max_tokens 1, logprobs 1; it reads
    token_logprobs[ctxlen:-1] and top_logprobs[ctxlen:-1] of each choice."""
    prompts = [[72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100] * 3, [84, 104, 101, 32, 99, 97, 116]]
    out = oai.completions.create(model="tiny", prompt=prompts, echo=True, max_tokens=1, logprobs=1,
                                 temperature=0, extra_headers={"x-pd-mode": mode})
    for choice, ids in zip(out.choices, prompts, strict=True):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert choice.text.startswith(bytes(ids).decode())
        expected = _transformers_logprobs(tiny_model_dir, ids)
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - expected[i - 1, ids[i]].item()) < 1e-4
            assert len(lp.top_logprobs[i]) >= 1
    # A cached prefix must not leave gaps: the same prompt again (now in the prefix cache)
    # returns every prompt logprob, unchanged.
    again = oai.completions.create(model="tiny", prompt=prompts[0], echo=True, max_tokens=1, logprobs=1,
                                   temperature=0, extra_headers={"x-pd-mode": mode})
    assert again.choices[0].logprobs.token_logprobs[:len(prompts[0])] == \
        out.choices[0].logprobs.token_logprobs[:len(prompts[0])]
    only_prompt = oai.completions.create(model="tiny", prompt="echo me", echo=True, max_tokens=0,
                                         extra_headers={"x-pd-mode": mode})
    assert only_prompt.choices[0].text == "echo me" and only_prompt.usage.completion_tokens == 0


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_generated_logprobs_shapes(oai, mode):
    text = oai.completions.create(model="tiny", prompt="shapes of logprobs " * 3, max_tokens=3, logprobs=2,
                                  temperature=0, extra_headers={"x-pd-mode": mode}).choices[0]
    assert len(text.logprobs.tokens) == len(text.logprobs.token_logprobs) == 3
    assert all(len(top) >= 1 for top in text.logprobs.top_logprobs)
    assert "".join(text.logprobs.tokens) == text.text or text.finish_reason == "stop"
    chat = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2,
                                       temperature=0, extra_headers={"x-pd-mode": mode}).choices[0]
    content = chat.logprobs.content
    assert len(content) >= 1 and all(len(t.top_logprobs) == 2 and t.bytes for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    stream = oai.completions.create(model="tiny", prompt="shapes of logprobs " * 3, max_tokens=3, logprobs=2,
                                    temperature=0, stream=True, extra_headers={"x-pd-mode": mode})
    parts = [c for part in stream for c in part.choices if c.logprobs]
    streamed = [lp for c in parts for lp in c.logprobs.token_logprobs]
    # The same tokens; the values within float32 rounding: the first request's prompt was
    # attended whole by the causal kernel, the repeat finds it in the prefix cache and
    # attends its last block through the masked one, which sums in another order.
    assert [t for c in parts for t in c.logprobs.tokens] == text.logprobs.tokens
    assert streamed == pytest.approx(text.logprobs.token_logprobs, abs=1e-5)


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_generated_logprobs_equal_transformers(oai, client, tiny_model_dir, mode):
    """Each generated token's logprob and its top alternatives are transformers'
    log-softmax at that position (fp32), whichever route prefilled the prompt."""
    prompt = "logprobs of what comes next " * 2
    ids = client.post("/tokenize", json={"model": "tiny", "prompt": prompt}).json()["tokens"]
    out = oai.completions.create(model="tiny", prompt=prompt, max_tokens=5, logprobs=3, temperature=0,
                                 extra_headers={"x-pd-mode": mode}).choices[0]
    token_ids = _generated_ids(client, prompt, mode)
    expected = _transformers_logprobs(tiny_model_dir, ids + token_ids)
    assert len(out.logprobs.token_logprobs) == len(token_ids)
    for i, (token_id, logprob) in enumerate(zip(token_ids, out.logprobs.token_logprobs, strict=True)):
        row = expected[len(ids) + i - 1]
        assert abs(logprob - row[token_id].item()) < 1e-4
        # Keyed by token text: tokens with the same text share a key (the most likely kept).
        top = sorted(out.logprobs.top_logprobs[i].values(), reverse=True)
        true_top = row.topk(3).values.tolist()
        assert top[0] == pytest.approx(true_top[0], abs=1e-4)
        assert all(min(abs(v - t) for t in true_top) < 1e-4 for v in top)


def _generated_ids(client, prompt: str, mode: str) -> list[int]:
    r = client.post("/v1/completions", headers={"x-pd-mode": mode},
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0,
                          "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_response_format_json_schema_holds_or_is_a_400(oai, mode):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": True}}
    out = oai.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=6, seed=1,
                                      response_format=fmt, extra_headers={"x-pd-mode": mode}).choices[0]
    if out.finish_reason == "stop":
        assert set(json.loads(out.message.content)) == {"a"}
    bad = {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "nonsense"}}}
    _bad_request(lambda: oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                                     response_format=bad), "response_format")


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_lm_eval_loglikelihoods_match_transformers(client, tiny_model_dir, tmp_path, mode):
    """lm-eval-harness's `local-completions` runs a multiple-choice task against the server;
    its loglikelihoods equal transformers' own on both routes."""
    from tests.lm_eval_support import reference_loglikelihoods, served_loglikelihoods, write_task

    served = served_loglikelihoods(str(client.base_url), tiny_model_dir.name, tiny_model_dir,
                                   write_task(tmp_path / "task"), {"x-pd-mode": mode})
    reference = reference_loglikelihoods(tiny_model_dir)
    assert [len(row) for row in served] == [len(row) for row in reference]
    for got, want in zip(served, reference, strict=True):
        assert got == pytest.approx(want, abs=1e-3)


# ---- n > 1, penalties and structured outputs on both routes -----------------------------


def _prompt_tokens_computed(client) -> dict[str, float]:
    """Prompt tokens computed per pool, by every replica up to this call (`fresh`)."""
    r = client.get("/metrics", params={"fresh": "true"})
    assert r.headers["x-pdc-stale-sources"] == "0"
    return _sum_by(r.text, "pdc_prompt_tokens_computed_total", "pool")


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_n_choices_are_seeded_singles_and_the_prompt_is_prefilled_once(client, mode):
    """n = 3: choice i is what an n = 1 request with seed + i returns; usage counts the prompt
    once and every generated token; the prompt is computed once, by the pool that prefills."""
    prompt = f"{mode}: a fresh prompt for three sampled continuations, prefilled only once"
    body = {"prompt": prompt, "temperature": 1.0, "seed": 1234, "max_tokens": 8, "return_token_ids": True}
    before = _prompt_tokens_computed(client)
    r = client.post("/v1/completions", json={**body, "n": 3}, headers={"x-pd-mode": mode})
    assert r.status_code == 200, r.text
    assert r.headers["x-pd-route"] == mode
    out = r.json()
    num_prompt_tokens = len(out["prompt_token_ids"])
    pool = "prefill" if mode == "disagg" else "decode"
    after = _prompt_tokens_computed(client)
    computed = {p: after.get(p, 0) - before.get(p, 0) for p in ("prefill", "decode")}
    assert computed[pool] == num_prompt_tokens and sum(computed.values()) == num_prompt_tokens, computed
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["prompt_tokens"] == num_prompt_tokens
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
    for i, choice in enumerate(out["choices"]):
        single = client.post("/v1/completions", json={**body, "seed": 1234 + i}, headers={"x-pd-mode": mode})
        expected = single.json()["choices"][0]
        assert (choice["token_ids"], choice["text"], choice["finish_reason"]) == \
            (expected["token_ids"], expected["text"], expected["finish_reason"]), i
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1  # the seeds differ, so do the samples


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32).eval()


PENALTIES = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0, frequency_penalty=-0.3),
             dict(repetition_penalty=1.8)]


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_penalties_over_http_follow_the_reference_formulas(client, hf_tiny, mode):
    """Greedy with each penalty gives, token for token, what OpenAI's formula (HF's for the
    repetition penalty) applied to transformers' logits predicts; logit_bias +100 forces a token."""
    from tests.test_penalties import reference_greedy
    from workers.engine import SamplingParams

    prompt = list(b"abababababab cdcdcd")  # every penalty below changes its greedy output
    body = {"prompt": prompt, "temperature": 0, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
    headers = {"x-pd-mode": mode}

    def served(**extra) -> list[int]:
        r = client.post("/v1/completions", json={**body, **extra}, headers=headers)
        assert r.status_code == 200 and r.headers["x-pd-route"] == mode, r.text
        return r.json()["choices"][0]["token_ids"]

    plain = served()
    for penalty in PENALTIES:
        expected = reference_greedy(hf_tiny, prompt, SamplingParams(max_tokens=12, temperature=0.0, **penalty))
        assert served(**penalty) == expected, penalty
        assert expected != plain, f"{penalty} changed nothing: the check proves nothing"
    assert served(logit_bias={"42": 100}) == [42] * 12


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "tags", "ok"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_json_schema_holds_for_50_seeded_samples(oai, mode):
    """Seeds 0..49 at temperature 1 (n = 10 from five seed bases): every output that stops
    validates; one cut by max_tokens says `length`; json_object gives an object."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    def sample(seed_base: int, fmt=JSON_SCHEMA_FORMAT, max_tokens=MAX_TOKENS_LIMIT):
        raw = oai.chat.completions.with_raw_response.create(
            model="tiny", messages=CHAT, n=10, seed=seed_base, temperature=1.0, max_completion_tokens=max_tokens,
            response_format=fmt, extra_headers={"x-pd-mode": mode})
        assert raw.headers["x-pd-route"] == mode
        return raw.parse().choices

    with ThreadPoolExecutor(5) as pool:
        choices = [c for batch in pool.map(sample, range(0, 50, 10)) for c in batch]
    assert len(choices) == 50
    stopped = [c for c in choices if c.finish_reason == "stop"]
    assert {c.finish_reason for c in choices} <= {"stop", "length"}
    assert len(stopped) >= 25, [c.message.content for c in choices if c.finish_reason != "stop"]
    for c in stopped:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    cut = sample(0, max_tokens=5)
    assert {c.finish_reason for c in cut} == {"length"}
    objects = sample(100, fmt={"type": "json_object"})
    assert all(isinstance(json.loads(c.message.content), dict) for c in objects if c.finish_reason == "stop")


def test_unsupported_schemas_and_streamed_best_of_are_400s(oai):
    no_schema = {"type": "json_schema"}
    _bad_request(lambda: oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                                     response_format=no_schema), "response_format.json_schema")
    unique = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}}}
    error = _bad_request(lambda: oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                                             response_format=unique), "response_format")
    assert "uniqueItems" in error["message"]
    _bad_request(lambda: oai.completions.create(model="tiny", prompt="x", max_tokens=2, n=1, best_of=2,
                                                stream=True), "best_of")


def test_admin_steps_lists_every_replicas_step_and_transfer_records(client):
    assert_openai_error(client.get("/admin/steps"), 401)
    assert_openai_error(client.get("/admin/steps", headers={"authorization": "Bearer nope"}), 401)
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert_openai_error(client.get("/admin/steps?limit=-1", headers=auth), 400)
    started = time.time()
    for mode in ("local", "disagg"):
        assert complete(client, "records of steps and transfers " * 3, headers={"x-pd-mode": mode}).status_code == 200
    deadline = time.monotonic() + 10  # a router replica's view may lag the registry by a poll
    while True:
        replicas = client.get(f"/admin/steps?since={started}", headers=auth).json()["replicas"]
        by_role = {role: [r for r in replicas.values() if r["role"] == role] for role in ("prefill", "decode")}
        if all(any(r["steps"] for r in by_role[role]) for role in by_role) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all("error" not in r for r in replicas.values()), replicas
    assert all(any(r["steps"] for r in by_role[role]) for role in by_role), replicas
    step = by_role["decode"][0]["steps"][-1]
    assert {"start_time", "step_time_s", "num_prefill_tokens", "num_decode_seqs", "num_prefill_seqs",
            "prefill_attention_work"} <= step.keys() and step["start_time"] >= started
    [transfer] = [t for r in by_role["prefill"] for t in r["transfers"]]  # the one disaggregated request
    assert transfer["num_bytes"] > 0 and 0 < transfer["tail_seconds"] <= transfer["seconds"]
    assert not any(r["transfers"] for r in by_role["decode"])
    newest = client.get("/admin/steps?limit=1", headers=auth).json()["replicas"]
    assert all(len(r["steps"]) <= 1 and len(r["transfers"]) <= 1 for r in newest.values())
    future = client.get(f"/admin/steps?since={time.time() + 3600}", headers=auth).json()["replicas"]
    assert future.keys() == replicas.keys() and not any(r["steps"] or r["transfers"] for r in future.values())


def _predicted(r) -> tuple[float, float]:
    return float(r.headers["x-pd-predicted-ttft-ms"]), float(r.headers["x-pd-predicted-tpot-ms"])


@pytest.mark.parametrize("mode", ["auto", "threshold", "local", "disagg"])
def test_every_response_carries_the_routes_predictions(client, mode):
    headers = {"x-pd-mode": mode}
    r = complete(client, f"what does the {mode} route expect " * 3, headers=headers, max_tokens=4)
    assert r.status_code == 200, r.text
    ttft_ms, tpot_ms = _predicted(r)
    assert 0 < ttft_ms < 60_000 and 0 < tpot_ms < 60_000
    if mode in ("local", "disagg"):
        assert r.headers["x-pd-route"] == mode
    body = {"prompt": "a streamed answer predicts too", "max_tokens": 3, "stream": True, "temperature": 0}
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as streamed:
        assert streamed.status_code == 200
        assert all(v > 0 for v in _predicted(streamed))
        streamed.read()


def test_auto_explains_its_choice_with_an_slo_reason(client):
    r = complete(client, "an auto request with the default objectives " * 2, headers={"x-pd-mode": "auto"})
    assert r.status_code == 200, r.text
    assert r.headers["x-pd-reason"] in ("slo-local", "slo-disagg", "protect-streams", "no-route-meets-slo",
                                        "explore")


def test_admin_policy_shows_models_and_corrections_and_resets(client):
    assert_openai_error(client.get("/admin/policy"), 401)
    assert_openai_error(client.post("/admin/policy/reset"), 401)
    auth = {"authorization": f"Bearer {TOKEN}"}
    deadline = time.monotonic() + 30  # two router replicas: keep going until one answers with what it learned
    while True:
        for mode in ("local", "disagg"):
            complete(client, f"teach the router replicas {time.monotonic()} " * 2, headers={"x-pd-mode": mode},
                     max_tokens=4)
        policy = client.get("/admin/policy", headers=auth).json()
        learned = {rid: r for rid, r in policy["replicas"].items() if r.get("corrections")}
        transfers = [r["transfer_model"] for r in policy["replicas"].values() if r.get("role") == "prefill"]
        if (learned and any(transfers)) or time.monotonic() > deadline:
            break
    roles = {r["role"] for r in policy["replicas"].values() if "role" in r}
    assert roles == {"prefill", "decode"}, policy
    for replica in policy["replicas"].values():
        if "role" in replica:
            assert {"fixed_s", "prefill_token_s", "decode_seq_s", "num_samples"} <= replica["step_model"].keys()
    assert learned, policy
    entry = next(iter(next(iter(learned.values()))["corrections"].values()))
    assert entry["factor"] > 0 and entry["num_samples"] >= 1 and entry["updated_at"] > 0
    assert any("*" in t for t in transfers if t), transfers
    assert policy["settings"]["default_slo"] == {"ttft_ms": 2000.0, "tpot_ms": 200.0}
    reset = client.post("/admin/policy/reset", headers=auth).json()
    assert reset["reset_at"] is not None
    assert not any(r.get("corrections") for r in reset["replicas"].values()), reset


def test_admin_decisions_explain_each_route_with_every_candidate_priced(client):
    assert_openai_error(client.get("/admin/decisions"), 401)
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert_openai_error(client.get("/admin/decisions?limit=x", headers=auth), 400)
    sent: set[str] = set()
    deadline = time.monotonic() + 30  # two router replicas: until the one answering has routed one of ours
    while True:
        request_id = f"explain-{len(sent)}-{time.monotonic_ns()}"
        sent.add(request_id)
        r = complete(client, f"explain this route {request_id} " * 4, max_tokens=3,
                     headers={"x-pd-mode": "auto", "x-request-id": request_id})
        assert r.status_code == 200, r.text
        body = client.get("/admin/decisions?limit=5", headers=auth).json()
        ours = [d for d in body["decisions"] if d["request_id"] in sent]
        if ours or time.monotonic() > deadline:
            break
    assert body["router"] and len(body["decisions"]) <= 5
    d = ours[-1]
    assert d["route"] in ("local", "disagg") and d["prompt_len"] > 0 and d["max_tokens"] == 3
    kinds = {a["kind"] for a in d["alternatives"]}
    assert d["kind"] in kinds and {"local", "remote"} <= kinds
    assert all(a["ttft_ms"] > 0 and isinstance(a["meets"], bool) for a in d["alternatives"])
    assert d["prefills"]
    if d["kind"] == "whole":  # the request runs whole on an idle prefill replica: it decodes there
        assert d["decode_replica"] == d["prefill_replica"] in {p["replica"] for p in d["prefills"]}
    else:
        assert d["decode"]["replica"] == d["decode_replica"]


@pytest.fixture()
def unplaced_app(ray_cluster, tiny_model_dir, tmp_path, client):
    """Deploys an app whose chosen pools can never be placed; yields (client, deploy)."""
    from ray import serve

    from cluster.app import build_app

    serve.delete(APP)  # free the CPUs of the main app (the last tests to use it ran above)
    token = tmp_path / "admin"
    token.write_text(TOKEN)
    names = []

    def deploy(name, **overrides):
        config = _config(tiny_model_dir, token, router={"num_replicas": 1, "num_cpus": 0}, **overrides)
        serve._run(build_app(config), _blocking=False, name=name, route_prefix="/")
        names.append(name)

    with httpx.Client(base_url=f"http://127.0.0.1:{ray_cluster['http_port']}", timeout=60) as c:
        yield c, deploy
    for name in names:
        serve.delete(name)


def test_health_degraded_without_prefill_then_503_without_any(unplaced_app):
    from ray import serve

    client, deploy = unplaced_app
    deploy("pdc-no-prefill", prefill=NOWHERE)
    r = _wait_health(client, lambda r: r.status_code == 200)
    assert r.json()["status"] == "degraded"
    assert r.json()["pools"]["prefill"]["status"] == "down"
    done = complete(client, "a long prompt that wants a prefill replica " * 2, headers={"x-pd-mode": "disagg"})
    assert done.status_code == 200
    assert (done.headers["x-pd-route"], done.headers["x-pd-reason"]) == ("local", "prefill-unhealthy")
    serve.delete("pdc-no-prefill")

    deploy("pdc-no-workers", prefill=NOWHERE, decode=NOWHERE)
    r = _wait_health(client, lambda r: r.status_code == 503 and "error" not in r.json())
    assert r.json()["status"] == "unavailable"
    assert_openai_error(complete(client), 503)
