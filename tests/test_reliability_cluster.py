"""The fault-injection suite on the real app over real HTTP: auth, quotas and 429s,
limits, client disconnects, deadlines (both counted on `/metrics` by tenant), corrupt and
stalled KV transfers, a soak, secrets absent from every log, replicas killed under load.

One app (1 prefill + 2 decode replicas) serves the module; the tests that kill a replica
run last. After every test an autouse fixture checks every live replica's invariants
through `debug_state` (engine integrity, every block free, nothing open or pending).
Tolerances are for a loaded 2-core CI machine; `python -m tests.reliability_report`
gives the precise figures (docs/reliability.md)."""

from __future__ import annotations

import concurrent.futures
import os
import random
import threading
import time

import httpx
import pytest
import yaml

from tests import fuzz_requests
from tests import reliability_support as rs
from tests.reliability_support import completion, record, stream

LONG = 1500  # tokens in a "long" generation (stops only by length: ignore_eos)
PROMPT = list(range(20, 90))  # 70 token ids: above min_remote_prefill_tokens
REPEATS = int(os.environ.get("PDC_RELIABILITY_REPEATS", "2"))  # the report raises it
IDLE_TOLERANCE_S = float(os.environ.get("PDC_IDLE_TOLERANCE_S", "5"))  # CI; 1 s measured in the report


@pytest.fixture(scope="module")
def secrets_():
    return rs.Secrets()


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_model_dir, tmp_path_factory, secrets_):
    from ray import serve

    from cluster.app import build_app

    files = rs.write_secret_files(tmp_path_factory.mktemp("reliability-secrets"), secrets_)
    serve.run(build_app(rs.app_config(tiny_model_dir, files)), name=rs.APP, route_prefix="/")
    url = f"http://127.0.0.1:{ray_cluster['http_port']}"
    with httpx.Client(base_url=url, timeout=60) as client:
        rs.wait_health(client)
        yield client
    rs.write_figures()
    serve.delete(rs.APP)


@pytest.fixture(scope="module")
def auth(secrets_):
    return {"authorization": f"Bearer {secrets_.keys['main']}"}


@pytest.fixture(autouse=True)
def invariants(cluster):
    yield
    rs.set_faults({"kv_transfer": "none"})
    elapsed, problems = rs.wait_all_idle(timeout_s=30)
    assert not problems, f"replicas not idle {elapsed:.1f} s after the scenario: {problems}"


# ---- auth, quotas, limits ---------------------------------------------------------------


def test_api_keys_required_when_configured(cluster, auth, secrets_):
    body = completion("hi", max_tokens=1)
    rs.assert_error(cluster.post("/v1/completions", json=body), 401, "invalid_api_key")
    rs.assert_error(cluster.post("/v1/completions", json=body, headers={"authorization": "Bearer sk-nope"}), 401)
    rs.assert_error(cluster.get("/v1/models"), 401)
    assert cluster.get("/v1/models", headers=auth).status_code == 200
    assert cluster.post("/v1/completions", json=body, headers=auth).status_code == 200
    # The admin API takes only the admin token, never a tenant's key.
    rs.assert_error(cluster.get("/admin/workloads", headers=auth), 401)
    admin = {"authorization": f"Bearer {secrets_.admin_token}"}
    assert cluster.get("/admin/workloads", headers=admin).status_code == 200


def test_tenant_rate_limit_is_429_with_retry_after(cluster, secrets_):
    headers = {"authorization": f"Bearer {secrets_.keys['limited']}"}  # rate 1/s, burst 2
    codes = [cluster.post("/v1/completions", json=completion("hi", max_tokens=1), headers=headers)
             for _ in range(4)]
    assert [r.status_code for r in codes[:2]] == [200, 200]
    limited = [r for r in codes if r.status_code == 429]
    assert limited, [r.status_code for r in codes]
    for r in limited:
        rs.assert_error(r, 429, "rate_limit_exceeded")
        assert int(r.headers["retry-after"]) >= 1
    time.sleep(1.2)
    assert cluster.post("/v1/completions", json=completion("hi", max_tokens=1), headers=headers).status_code == 200


def test_tenant_concurrency_quota(cluster, secrets_):
    headers = {"authorization": f"Bearer {secrets_.keys['single']}"}  # concurrency 1
    started = threading.Event()
    body = completion(PROMPT, max_tokens=LONG, ignore_eos=True)
    with httpx.Client(base_url=str(cluster.base_url), timeout=60) as other:
        worker = concurrent.futures.ThreadPoolExecutor(1).submit(
            stream, other, body, headers, lambda res: started.set() or res.num_tokens >= 64)
        assert started.wait(30)
        r = cluster.post("/v1/completions", json=completion("hi", max_tokens=1), headers=headers)
        rs.assert_error(r, 429, "concurrency_limit_exceeded")
        assert r.headers["retry-after"] == "1"
        assert worker.result(60).status == 200
    time.sleep(0.3)  # the router releases the slot when the stream closes
    assert cluster.post("/v1/completions", json=completion("hi", max_tokens=1), headers=headers).status_code == 200


def test_overload_gets_429_never_5xx_or_a_hang(cluster, auth):
    """More concurrent requests than running + queued slots (12 + 6): the rest are 429."""
    body = completion(PROMPT, max_tokens=24, ignore_eos=True)

    def one(i: int) -> httpx.Response:
        with httpx.Client(base_url=str(cluster.base_url), timeout=120) as c:
            return c.post("/v1/completions", json={**body, "seed": i}, headers=auth)

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(one, range(40)))
    codes = sorted(r.status_code for r in answers)
    record("overload_40_concurrent", {"ok": codes.count(200), "429": codes.count(429),
                                       "seconds": round(time.monotonic() - start, 2)})
    assert set(codes) <= {200, 429}, {r.status_code: r.text[:300] for r in answers}
    assert codes.count(429) >= 1 and codes.count(200) >= 12, codes
    for r in answers:
        if r.status_code == 429:
            rs.assert_error(r, 429)
            assert int(r.headers["retry-after"]) >= 1


def test_prompt_too_long_names_the_limit(cluster, auth):
    r = cluster.post("/v1/completions", json=completion([i % 250 for i in range(2100)], max_tokens=1), headers=auth)
    error = rs.assert_error(r, 400, "context_length_exceeded")
    assert str(rs.MAX_MODEL_LEN) in error["message"] and "2100" in error["message"]
    chat = {"messages": [{"role": "user", "content": "x" * 2100}], "max_tokens": 1}
    assert str(rs.MAX_MODEL_LEN) in rs.assert_error(
        cluster.post("/v1/chat/completions", json=chat, headers=auth), 400)["message"]
    big = cluster.post("/v1/completions", content=b"{" + b" " * 70_000 + b"}",
                       headers={**auth, "content-type": "application/json"})
    assert str(64 * 1024) in rs.assert_error(big, 413)["message"]


# ---- faults -----------------------------------------------------------------------------


def test_client_disconnect_frees_blocks_on_every_replica(cluster, auth):
    """The client hangs up mid-stream of a disaggregated request: the decode and the
    prefill replica it touched abort it and every block is free again."""
    for _ in range(REPEATS):
        result = stream(cluster, completion(PROMPT, max_tokens=LONG, ignore_eos=True),
                        {**auth, "x-pd-mode": "disagg"}, lambda res: res.num_tokens >= 8)
        hung_up = time.monotonic()
        assert result.headers["x-pd-route"] == "disagg" and not result.done
        _, problems = rs.wait_all_idle(timeout_s=30)
        freed_s = time.monotonic() - hung_up  # hang-up -> every replica seen idle
        record("disconnect_free_s", round(freed_s, 3))
        assert not problems, problems
        assert freed_s <= IDLE_TOLERANCE_S, freed_s


def test_deadline_per_profile_aborts_everywhere(cluster, auth):
    """Profile `tight` has `deadline_s: 1.0`: a long request ends with a clear error."""
    headers = {**auth, "x-workload": "tight", "x-pd-mode": "disagg"}
    start = time.monotonic()
    result = stream(cluster, completion(PROMPT, max_tokens=LONG, ignore_eos=True), headers)
    assert result.done and result.error is not None, result.events[-3:]
    assert result.error["code"] == "deadline_exceeded" and "deadline" in result.error["message"]
    overshoot = time.monotonic() - start - 1.0
    record("deadline_overshoot_s", round(overshoot, 3))
    assert overshoot < IDLE_TOLERANCE_S
    r = cluster.post("/v1/completions", json=completion(PROMPT, max_tokens=LONG, ignore_eos=True), headers=headers)
    assert r.status_code in (503, 504, 408) and r.json()["error"]["code"] == "deadline_exceeded", r.text


def test_metrics_count_429s_and_timeouts_by_tenant(cluster, auth, secrets_):
    """`/metrics` names the tenant of each 429 and of each request its deadline ended,
    and shows both stages of the queue histogram and every replica's preemptions."""
    limited = {"authorization": f"Bearer {secrets_.keys['limited']}"}  # rate 1/s, burst 2
    codes = [cluster.post("/v1/completions", json=completion("hi", max_tokens=1), headers=limited).status_code
             for _ in range(4)]
    assert 429 in codes, codes
    r = cluster.post("/v1/completions", json=completion(PROMPT, max_tokens=LONG, ignore_eos=True),
                     headers={**auth, "x-workload": "tight"})
    assert r.json()["error"]["code"] == "deadline_exceeded", r.text
    wanted = {
        "pdc_requests_rejected_total": {"tenant": "limited", "code": "rate_limit_exceeded"},
        "pdc_request_timeouts_total": {"tenant": "main", "workload": "tight"},
        "pdc_request_queue_seconds_count": {"stage": "admission"},
    }
    deadline = time.monotonic() + 15  # the other router replicas push theirs every 2 s
    while True:
        missing = {name: labels for name, labels in wanted.items()
                   if not any(labels.items() <= got.items() and value > 0
                              for got, value in rs.metric_samples(cluster, name))}
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert not missing, missing
    assert any(got["stage"] == "engine" and value > 0
               for got, value in rs.metric_samples(cluster, "pdc_request_queue_seconds_count"))
    pools = {got["pool"] for got, _ in rs.metric_samples(cluster, "pdc_num_preemptions_total")}
    assert pools == {"decode", "prefill"}, pools


def _greedy(cluster, auth, mode: str) -> httpx.Response:
    body = completion(PROMPT, max_tokens=8, return_token_ids=True)
    return cluster.post("/v1/completions", json=body, headers={**auth, "x-pd-mode": mode})


def test_corrupt_kv_transfer_falls_back_locally(cluster, auth):
    expected = _greedy(cluster, auth, "local").json()["choices"][0]["token_ids"]
    rs.set_faults({"kv_transfer": "corrupt"})
    for _ in range(REPEATS):
        start = time.monotonic()
        r = _greedy(cluster, auth, "disagg")
        record("corrupt_fallback_s", round(time.monotonic() - start, 3))
        assert r.status_code == 200, r.text
        assert (r.headers["x-pd-route"], r.headers["x-pd-reason"]) == ("local", "prefill-failed")
        assert r.json()["choices"][0]["token_ids"] == expected
    assert sum(f["num_injected"] for f in rs.set_faults({"kv_transfer": "none"})) >= REPEATS
    assert _greedy(cluster, auth, "disagg").headers["x-pd-route"] == "disagg"  # healed


def test_stalled_kv_transfer_falls_back_within_the_timeout(cluster, auth):
    expected = _greedy(cluster, auth, "local").json()["choices"][0]["token_ids"]
    rs.set_faults({"kv_transfer": "stall"})
    start = time.monotonic()
    r = _greedy(cluster, auth, "disagg")
    seconds = time.monotonic() - start
    record("stall_fallback_s", round(seconds, 3))
    assert r.status_code == 200, r.text
    assert (r.headers["x-pd-route"], r.headers["x-pd-reason"]) == ("local", "prefill-timeout")
    assert r.json()["choices"][0]["token_ids"] == expected
    assert 3.0 <= seconds < 3.0 + 1.0 + IDLE_TOLERANCE_S  # prefill_timeout_s = 3


# ---- bad input --------------------------------------------------------------------------

def test_fuzz_malformed_requests_over_http(cluster, auth):
    """>= 1,000 malformed requests through the real proxy and router: each a 4xx with an
    OpenAI-shaped body, none >= 500, and the server healthy and serving afterwards."""
    fuzz_requests.SEEN.clear()
    start = time.monotonic()
    fuzz_requests.post_each(cluster, auth)
    record("fuzz", {"requests": len(fuzz_requests.SEEN), "5xx": sum(c >= 500 for c in fuzz_requests.SEEN),
                    "statuses": {str(c): fuzz_requests.SEEN.count(c) for c in sorted(set(fuzz_requests.SEEN))},
                    "seconds": round(time.monotonic() - start, 1)})
    assert len(fuzz_requests.SEEN) >= fuzz_requests.EXAMPLES
    assert cluster.get("/health").json()["status"] == "ok"
    ok = cluster.post("/v1/completions", json=completion("still serving", max_tokens=2), headers=auth)
    assert ok.status_code == 200, ok.text


# ---- soak, then secrets after all that traffic ------------------------------------------


@pytest.mark.soak
def test_soak_mixed_load(cluster, auth, tmp_path):
    """Sustained mixed load through the project's load tester (`PDC_SOAK_SECONDS`, 30 s
    by default; >= 300 for the full form): afterwards every block is free, nothing is
    pending, and no replica's resident memory grew by 10% or more."""
    from cluster.loadtest.api import run_loadtest
    from cluster.loadtest.config import LoadTestConfig

    seconds = float(os.environ.get("PDC_SOAK_SECONDS", "30"))
    workload = tmp_path / "mixed.yaml"
    workload.write_text(yaml.safe_dump(rs.SOAK_MIX))
    key = auth["authorization"][len("Bearer "):]
    warm = run_loadtest(LoadTestConfig(url=str(cluster.base_url), workload=str(workload), concurrency=4,
                                       num_requests=12, api_key=key, plots=False, timeout_s=120))
    assert warm.requests["failed"] == 0, warm.errors
    rs.wait_all_idle()
    before = {r.replica_id: rs.debug_state(r)["rss_bytes"] for r in rs.replicas()}
    summary = run_loadtest(LoadTestConfig(url=str(cluster.base_url), workload=str(workload), concurrency=6,
                                          duration_s=seconds, api_key=key, seed=1,
                                          out_dir=tmp_path / "soak", plots=False, timeout_s=120))
    freed_s, problems = rs.wait_all_idle(timeout_s=30)
    after = {r.replica_id: rs.debug_state(r)["rss_bytes"] for r in rs.replicas()}
    growth = {rid: after[rid] / before[rid] - 1 for rid in before if rid in after and before[rid]}
    requests = summary.requests
    record("soak", {"seconds": seconds, "completed": requests["completed"], "failed": requests["failed"],
                    "rss_growth_max": round(max(growth.values()), 4), "idle_after_s": round(freed_s, 3)})
    assert not problems, problems
    assert requests["completed"] > 0 and requests["failed"] == 0, (requests, summary.errors)
    assert summary.routes.get("disagg", 0) > 0 and summary.routes.get("local", 0) > 0, summary.routes
    assert max(growth.values()) < 0.10, growth


def test_secrets_never_logged(cluster, secrets_, capfd):
    """After all the traffic above (401s, 429s, admin calls, faults): no secret value in
    any log file of this Ray session (workers, Serve proxy/controller/replicas, raylet,
    GCS) nor in this process's captured output."""
    values = [v.encode() for v in secrets_.values()]
    leaks, num_files = rs.ray_log_leaks(values)
    out, err = capfd.readouterr()
    leaks += [("captured output", v[:6]) for v in values if v in (out + err).encode()]
    record("secrets_grep", {"secrets": len(values), "log_files": num_files, "hits": len(leaks)})
    assert num_files > 10, "no Ray logs found in this session's folder"
    assert not leaks, leaks


# ---- replicas killed under load (last: they restart replicas) ---------------------------


def test_decode_replica_killed_mid_stream(cluster, auth):
    """In flight on the killed replica: a stream ends with one SSE error event and
    [DONE], a non-streaming request is a 503 `replica_failed`; the other replica's
    requests complete untouched; requests sent right after are retried elsewhere and
    succeed; Serve starts a replacement."""
    body = completion(PROMPT, max_tokens=LONG, ignore_eos=True)
    reached = threading.Barrier(7, timeout=60)

    def on_event(res):
        if res.num_tokens >= 4 and not getattr(res, "_counted", False):
            res._counted = True
            reached.wait()
        return False

    def streamed(i: int):
        with httpx.Client(base_url=str(cluster.base_url), timeout=120) as c:
            return stream(c, {**body, "prompt": [i + 1, *PROMPT]}, {**auth, "x-pd-mode": "local"}, on_event)

    def plain(i: int) -> httpx.Response:
        with httpx.Client(base_url=str(cluster.base_url), timeout=120) as c:
            return c.post("/v1/completions", json={**body, "prompt": [i + 100, *PROMPT]},
                          headers={**auth, "x-pd-mode": "local"})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        plains = [pool.submit(plain, i) for i in range(2)]
        streams = [pool.submit(streamed, i) for i in range(6)]
        reached.wait()  # every stream has tokens; the plain requests started before them
        before = rs.replicas("decode")
        victim = before[0]
        num_on_victim = rs.debug_state(victim)["num_running"]
        rs.kill_replica(victim.replica_id)
        killed = time.monotonic()
        old_ids = {r.replica_id for r in before}
        replaced_s = rs.wait_for(lambda: [r for r in rs.replicas("decode") if r.replica_id not in old_ids], 150)
        results = [f.result(120) for f in streams]
        answers = [f.result(120) for f in plains]
    errors = [r for r in results if r.error is not None]
    failed_plain = [r for r in answers if r.status_code != 200]
    record("decode_kill", {"in_flight": 8, "on_victim": num_on_victim, "errored": len(errors) + len(failed_plain),
                           "new_replica_s": round(replaced_s, 2),
                           "all_ended_after_kill_s": round(time.monotonic() - killed, 2)})
    assert all(r.status == 200 and r.done for r in results), [r.events[-2:] for r in results]
    assert all(e.error["code"] == "replica_failed" for e in errors)
    for r in failed_plain:
        rs.assert_error(r, 503, "replica_failed")
    assert len(errors) + len(failed_plain) == num_on_victim, (num_on_victim, len(errors), len(failed_plain))
    assert all(r.num_tokens == LONG for r in results if r.error is None)
    assert all(len(r.json()["choices"][0]["text"]) > 0 for r in answers if r.status_code == 200)
    after = [cluster.post("/v1/completions", json=completion(f"after the kill {i}", max_tokens=2), headers=auth)
             for i in range(6)]
    assert [r.status_code for r in after] == [200] * 6, [r.text for r in after if r.status_code != 200]
    rs.wait_health(cluster)


def test_prefill_replica_killed_under_load_recovers(cluster, auth):
    """0 failed requests while the only prefill replica dies (local fallback), Serve
    starts a new one, and disaggregated routes come back (fresh long prompts: auto mode)."""
    results: list[tuple[float, int, str]] = []
    stop = threading.Event()

    def client(seed: int):
        rng = random.Random(seed)
        with httpx.Client(base_url=str(cluster.base_url), timeout=120) as c:
            while not stop.is_set():
                prompt = [rng.randrange(250) for _ in range(80)]  # uncached: auto -> disagg
                r = c.post("/v1/completions", json=completion(prompt, max_tokens=6), headers=auth)
                route = f"{r.headers.get('x-pd-route')}:{r.headers.get('x-pd-reason')}"
                results.append((time.monotonic(), r.status_code, route))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.5)
        victim = rs.replicas("prefill")[0].replica_id
        rs.kill_replica(victim)
        killed = time.monotonic()
        replaced_s = rs.wait_for(lambda: [r for r in rs.replicas("prefill") if r.replica_id != victim], 150)
        disagg_s = rs.wait_for(lambda: [1 for t, _, route in results[-20:]
                                      if t > killed + replaced_s and route == "disagg:long-prompt"], 60)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    routes = [route for _, _, route in results]
    record("prefill_kill", {"requests": len(results), "failed": sum(code != 200 for _, code, _ in results),
                            "fallbacks": sum(r.startswith("local:prefill-") for r in routes),
                            "new_replica_s": round(replaced_s, 2), "disagg_again_s": round(disagg_s, 2)})
    assert all(code == 200 for _, code, _ in results), [r for r in results if r[1] != 200]
    assert any(r.startswith("local:prefill-") for r in routes), set(routes)
    assert routes.count("disagg:long-prompt") > 0
