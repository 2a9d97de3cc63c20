"""The worker deployments on real Ray Serve with the real zmq KV transport, driven
through Serve handles (the router is tested through HTTP in test_cluster_*):
local and disaggregated greedy outputs equal the offline engine, every prefill failure
falls back to a local prefill that completes, and leaving a stream frees its blocks."""

from __future__ import annotations

import time

import pytest

from tests.engine_support import random_prompts
from workers.engine.sampling_params import SamplingParams
from workers.protocol import GenerateRequest

APP = "workers-test"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
PROMPT = list(range(20, 90))  # 70 tokens: 4 full blocks + a tail


@pytest.fixture(scope="module")
def workers(ray_cluster, tiny_model_dir):
    from ray import serve

    from router.control_plane import ControlPlane
    from workers.decode import DecodeDeployment
    from workers.prefill import PrefillDeployment

    config = {
        "model": {"path": str(tiny_model_dir)},
        "engine": {"num_kv_blocks": 128, "max_num_batched_tokens": 256},
        "prefill": {"num_cpus": 0.5}, "decode": {"num_cpus": 0.5},
        "transport": {"backend": "zmq", "host": "127.0.0.1"},
    }
    key = "workers-test-transport-key-0123456789"  # what cluster.app.build_app hands out
    cp = ControlPlane.bind({}, 3.0)
    prefill = PrefillDeployment.options(ray_actor_options={"num_cpus": 0.5}).bind(config, cp, key)
    decode = DecodeDeployment.options(ray_actor_options={"num_cpus": 0.5}).bind(config, prefill, cp, key)
    handle = serve.run(decode, name=APP, route_prefix=None)
    control = serve.get_deployment_handle("ControlPlane", APP)
    prefill_id = _wait_for_prefill(control)
    yield handle, serve.get_deployment_handle("PrefillWorker", APP), control, prefill_id
    serve.delete(APP)


def _wait_for_prefill(control) -> str:
    for _ in range(100):
        state = control.get_state.remote(None).result()
        ids = [r.replica_id for r in state.replicas if r.role == "prefill" and r.healthy]
        if ids and any(r.role == "decode" for r in state.replicas):
            return ids[0]
        time.sleep(0.1)
    raise AssertionError("workers did not register with the ControlPlane")


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    from workers.engine.llm_engine import LLMEngine

    engine = LLMEngine(str(tiny_model_dir), device="cpu", num_kv_blocks=128)
    return engine.generate([PROMPT], GREEDY)[0].token_ids


def _request(route: str, reason: str = "forced", **kw) -> GenerateRequest:
    return GenerateRequest(request_id=f"req-{time.monotonic_ns()}",
                           prompt_token_ids=kw.pop("prompt_token_ids", PROMPT),
                           params=kw.pop("params", GREEDY), seed=7, route=route, reason=reason, **kw)


def _run(handle, req):
    chunks = list(handle.options(stream=True).generate.remote(req))
    return [t for c in chunks for t in c.token_ids], chunks


def _wait_idle(handle, timeout_s: float = 2.0) -> dict:
    deadline = time.time() + timeout_s
    while True:
        stats = handle.check_integrity.remote().result()
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_open_reservations"] == 0
        if idle and stats["kv_blocks_free"] == stats["kv_blocks_total"] or time.time() > deadline:
            return stats
        time.sleep(0.05)


def test_local_equals_offline(workers, expected):
    handle = workers[0]
    token_ids, chunks = _run(handle, _request("local", "short-prompt"))
    assert token_ids == expected
    assert (chunks[0].route, chunks[0].reason) == ("local", "short-prompt")
    assert chunks[0].num_prompt_tokens == len(PROMPT)
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in chunks)


def test_disagg_equals_offline(workers, expected):
    handle, _, _, prefill_id = workers
    token_ids, chunks = _run(handle, _request("disagg", "long-prompt", prefill_replica=prefill_id))
    assert (chunks[0].route, chunks[0].reason) == ("disagg", "long-prompt")
    assert token_ids == expected
    stats = _wait_idle(handle)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_disaggregated_stream_says_its_transfers_tail(workers):
    """Once the prefill replica replied, one chunk carries the tail it measured; a local
    stream carries none."""
    handle, _, _, prefill_id = workers
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)  # long enough for the reply
    _, remote = _run(handle, _request("disagg", "long-prompt", prefill_replica=prefill_id, params=params))
    tails = [c.transfer_tail_s for c in remote if c.transfer_tail_s is not None]
    assert len(tails) == 1 and 0.0 <= tails[0] < 5.0, tails
    _, local = _run(handle, _request("local", "short-prompt", params=params))
    assert all(c.transfer_tail_s is None for c in local)


def test_disagg_text_equals_local(workers):
    """The first token's text arrives exactly once on the disaggregated route: a stream's
    text and finish are the local route's, also when a stop string or max_tokens=1 ends
    the request on the first token."""
    handle, _, _, prefill_id = workers
    prompt = random_prompts([40], seed=1)[0]  # its first token shows text at once
    first = _run(handle, _request("local", params=SamplingParams(max_tokens=1, temperature=0.0),
                                  prompt_token_ids=prompt))[1]
    first_text = "".join(c.text for c in first)
    assert first_text
    for params in (SamplingParams(max_tokens=12, temperature=0.0, stop=("zz",)),
                   SamplingParams(max_tokens=1, temperature=0.0),
                   SamplingParams(max_tokens=12, temperature=0.0, stop=(first_text[-1],))):
        _, local = _run(handle, _request("local", params=params, prompt_token_ids=prompt))
        _, remote = _run(handle, _request("disagg", params=params, prompt_token_ids=prompt,
                                          prefill_replica=prefill_id))
        assert remote[0].route == "disagg"
        assert "".join(c.text for c in local) == "".join(c.text for c in remote), params
        assert local[-1].finish_reason == remote[-1].finish_reason, params


def test_seeded_sampling_equal_across_routes(workers):
    handle, _, _, prefill_id = workers
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9)
    local, _ = _run(handle, _request("local", params=params))
    remote, _ = _run(handle, _request("disagg", params=params, prefill_replica=prefill_id))
    assert local == remote


def test_no_prefill_replica_falls_back(workers, expected):
    token_ids, chunks = _run(workers[0], _request("disagg", prefill_replica=None))
    assert (chunks[0].route, chunks[0].reason) == ("local", "prefill-unhealthy")
    assert token_ids == expected


def test_prefill_timeout_falls_back(workers, expected):
    handle, _, _, prefill_id = workers
    req = _request("disagg", prefill_replica=prefill_id, prefill_timeout_s=0.001)
    token_ids, chunks = _run(handle, req)
    assert (chunks[0].route, chunks[0].reason) == ("local", "prefill-timeout")
    assert token_ids == expected
    stats = _wait_idle(handle)
    assert stats["num_open_reservations"] == 0


def test_prefill_replica_runs_whole_request(workers, expected):
    _, prefill, _, _ = workers
    token_ids, chunks = _run(prefill, _request("local", "prefill-busy"))
    assert token_ids == expected and chunks[0].route == "local"


def test_leaving_a_stream_frees_blocks_within_1s(workers):
    handle = workers[0]
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    gen = handle.options(stream=True).generate.remote(_request("local", params=params))
    next(iter(gen))
    gen.cancel()
    start = time.time()
    stats = _wait_idle(handle, timeout_s=1.0)
    assert stats["num_running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert time.time() - start <= 1.0


def test_deadline_ends_with_an_error_chunk(workers):
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    _, chunks = _run(workers[0], _request("local", params=params, deadline=time.time() + 0.5))
    assert chunks[-1].finish_reason == "error" and chunks[-1].error["code"] == "deadline_exceeded"
    _wait_idle(workers[0])


def test_workers_heartbeat_metrics(workers):
    _, _, control, _ = workers
    text = control.render_metrics.remote().result().decode()
    for name in ("pdc_kv_blocks_free", "pdc_kv_blocks_total", "pdc_num_requests_running",
                 "pdc_prefix_cache_queries_total", "pdc_kv_transfer_bytes_total"):
        assert name in text, name
