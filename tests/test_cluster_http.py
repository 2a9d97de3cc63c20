"""The whole app from `cluster.app:build_app` on real Ray Serve, through real HTTP:
greedy token ids equal for `x-pd-mode: local` and `disagg` and to the offline engine,
streaming and non-streaming, chat, prefix affinity over two decode replicas, and a
prefill replica killed under load (requests complete via fallback, /health degraded)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

APP = "pd-http"
PROMPT = list(range(20, 90))  # 70 tokens
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def cluster_url(ray_cluster, tiny_model_dir):
    from ray import serve

    from cluster.app import build_app

    args = {
        "model": {"path": str(tiny_model_dir)},
        "engine": {"num_kv_blocks": 256, "max_num_batched_tokens": 256},
        "prefill": {"num_replicas": 1, "num_cpus": 0.25},
        "decode": {"num_replicas": 2, "num_cpus": 0.25},
        "router": {"num_cpus": 0.25, "heartbeat_timeout_s": 1.0, "prefill_timeout_s": 5.0},
        "transport": {"backend": "zmq", "host": "127.0.0.1"},
        "workloads": {"default": {"mode": "threshold", "min_remote_prefill_tokens": 32},
                      # every long prompt spills to a decode replica, in the background
                      "spill": {"mode": "threshold", "min_remote_prefill_tokens": 32, "max_prefill_queue": 0,
                                "max_local_prefill_tokens_while_decoding": 0}},
    }
    serve.run(build_app(args), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{ray_cluster['http_port']}"
    _wait_healthy(url)
    yield url
    serve.delete(APP)


def _wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            body = httpx.get(f"{url}/health", timeout=5).json()
            pools = body.get("pools", {})
            if body.get("status") == "ok" and pools.get("decode", {}).get("healthy") == 2:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("cluster did not become healthy")


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams

    engine = LLMEngine(str(tiny_model_dir), device="cpu", num_kv_blocks=64)
    return engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].token_ids


def _complete(url: str, mode: str, prompt=PROMPT, **body) -> httpx.Response:
    payload = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
               "return_token_ids": True, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, headers={"x-pd-mode": mode}, timeout=60)


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_greedy_tokens_equal_offline(cluster_url, expected, mode):
    r = _complete(cluster_url, mode)
    assert r.status_code == 200, r.text
    assert r.headers["x-pd-route"] == mode and r.headers["x-pd-reason"] == "forced"
    assert r.headers["x-request-id"]
    assert r.json()["choices"][0]["token_ids"] == expected


def _stream(url: str, mode: str) -> tuple[httpx.Headers, list[dict]]:
    payload = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, headers={"x-pd-mode": mode},
                      timeout=60) as r:
        assert r.status_code == 200
        headers = r.headers
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return headers, [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_streaming_equals_non_streaming(cluster_url, expected, mode):
    headers, events = _stream(cluster_url, mode)
    assert headers["x-pd-route"] == mode
    token_ids = [t for e in events for c in e.get("choices", []) for t in c.get("token_ids", [])]
    text = "".join(c.get("text", "") for e in events for c in e.get("choices", []))
    assert token_ids == expected
    assert text == _complete(cluster_url, mode).json()["choices"][0]["text"]
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS


def test_chat_both_routes_agree(cluster_url):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there " * 8}],
            "max_tokens": 8, "temperature": 0}
    answers = []
    for mode in ("local", "disagg"):
        r = httpx.post(f"{cluster_url}/v1/chat/completions", json=body, headers={"x-pd-mode": mode}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-pd-route"] == mode
        answers.append(r.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]


def _decode_stats(control) -> dict[str, dict]:
    state = control.get_state.remote(None).result()
    return {r.replica_id: r.stats for r in state.replicas if r.role == "decode"}


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica(cluster_url):
    from ray import serve

    control = serve.get_deployment_handle("ControlPlane", APP)
    time.sleep(1.2)  # earlier tests' stats reach the ControlPlane with the next heartbeat
    before = _decode_stats(control)
    prefix = list(range(150, 246))  # 6 full blocks shared by every request
    for i in range(5):
        r = _complete(cluster_url, "local", prompt=prefix + [10 + i, 11 + i, 12 + i], max_tokens=2)
        assert r.status_code == 200, r.text
    time.sleep(1.2)  # one heartbeat
    after = _decode_stats(control)
    hits = {rid: after[rid].get("prefix_cache_hits", 0) - before.get(rid, {}).get("prefix_cache_hits", 0)
            for rid in after}
    # All five went to one replica: the four after the first hit the 96-token prefix there.
    assert max(hits.values()) >= 4 * len(prefix), hits
    assert sorted(hits.values())[0] == 0, hits


def _background_prefills(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[-1]) for line in text.splitlines()
               if line.startswith("pdc_background_prefills_total"))


def test_a_spilled_prompt_prefills_in_the_background_token_identically(cluster_url, tiny_model_dir):
    """`threshold` spills a long prompt to a decode replica (prefill-busy), where the engine
    runs it as a background prefill (yield_to_decode); the tokens do not change."""
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams

    prompt = [32 + (i * 37) % 200 for i in range(70)]  # in no replica's prefix cache yet
    offline = LLMEngine(str(tiny_model_dir), device="cpu", num_kv_blocks=64)
    expected = offline.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].token_ids
    before = _background_prefills(cluster_url)
    r = httpx.post(f"{cluster_url}/v1/completions", headers={"x-workload": "spill"}, timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert (r.headers["x-pd-route"], r.headers["x-pd-reason"]) == ("local", "prefill-busy")
    assert r.json()["choices"][0]["token_ids"] == expected
    deadline = time.time() + 10  # the counter reaches /metrics with the next heartbeat
    while _background_prefills(cluster_url) < before + 1 and time.time() < deadline:
        time.sleep(0.2)
    assert _background_prefills(cluster_url) >= before + 1


def test_metrics_show_interface_names(cluster_url):
    text = httpx.get(f"{cluster_url}/metrics", timeout=10).text
    for name in ("pdc_time_to_first_token_seconds", "pdc_route_decisions_total", "pdc_kv_transfer_bytes_total",
                 "pdc_prefix_cache_hits_total", "pdc_kv_blocks_free", "pdc_num_requests_running"):
        assert name in text, name


def _prefill_actor():
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if f"{APP}#PrefillWorker" in actor["name"]:
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError("no prefill replica actor")


def test_killed_prefill_replica_under_load(cluster_url, expected):
    """Run last in this module: it kills the only prefill replica."""
    import ray

    results: list[tuple[int, str, list[int]]] = []
    stop = threading.Event()

    def client():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                r = c.post(f"{cluster_url}/v1/completions", headers={"x-pd-mode": "disagg"},
                           json={"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                 "temperature": 0, "return_token_ids": True})
                ids = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else []
                results.append((r.status_code, r.headers.get("x-pd-route", "") + ":" +
                                r.headers.get("x-pd-reason", ""), ids))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    ray.kill(_prefill_actor(), no_restart=True)
    statuses = []
    deadline = time.time() + 15
    while time.time() < deadline and "degraded" not in statuses:
        statuses.append(httpx.get(f"{cluster_url}/health", timeout=10).json()["status"])
        time.sleep(0.1)
    time.sleep(2.0)  # requests planned while the pool is down
    stop.set()
    for t in threads:
        t.join(60)
    assert "degraded" in statuses, statuses
    assert results and all(code == 200 for code, _, _ in results), [r[:2] for r in results if r[0] != 200]
    assert all(ids == expected for _, _, ids in results)
    fallbacks = {route for _, route, _ in results} & {
        "local:prefill-failed", "local:prefill-timeout", "local:prefill-unhealthy"}
    assert fallbacks, {route for _, route, _ in results}
