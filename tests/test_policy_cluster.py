"""`auto` on a real Serve app notices when disaggregation hurts, and when it stops hurting.

One prefill and one decode replica (tiny model), faults enabled. The decode replica is
kept queued with forced-local long prompts, so `auto` sends a fresh prompt remote. Then
every KV layer the prefill replica sends is delayed: the slow transfers reach the
predictions (the prefill replica's fit of its transfer tails, the router's corrections)
and routing shifts local, with nobody touching a threshold. Once the delay is gone the
evidence ages out and remote comes back. Both forget within seconds here
(`router.correction_half_life_s`, `router.transfer_cost_max_age_s`); the defaults are a
minute.

How many probes go remote before routing settles local is the product's to bound, not
the machine's to time: the first slowed transfer's tail, back with its stream, prices
the link for the router at once (`corrections.LINK_REPORT_S`), the replica's fit takes one
stall for a blip and the second for a change, and a probe may leave before the replica's
report reaches the router. So the test probes under the fault for at least three such
windows and until eight in a row went local (at most 18 s, inside the link's 24 s
memory), and bounds the remote ones at four (two here as a rule).

The probes' TTFT objective (600 ms) is one the slowed path misses (about 0.85 s) and
both paths meet otherwise (remote 0.05-0.1 s, local 0.15-0.3 s). Under a loose one (10 s)
a slowed transfer priced right is still in time, and `auto` rightly keeps sending some
prompts remote where that spares the decode replica's queue.
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

APP = "pdc-policy-fault"
DELAY_S = 0.4  # per KV layer: the tiny model's two layers add 0.8 s to a remote first token
SETTLED = 8  # probes in a row that went local: routing has shifted
MAX_REMOTE_UNDER_FAULT = 4  # two stalls (a blip, then a change), one sent as a late report lands, one spare
MIN_FAULT_S = 6.0  # past a stalled transfer's own evidence (`corrections.LINK_REPORT_S`): the link fit's turn
MAX_FAULT_S = 18.0  # under the link's memory (`transfer_cost_max_age_s`): no evidence ages out meanwhile


def _config(model_dir) -> dict:
    return {
        "model": {"path": str(model_dir), "max_model_len": 2048},
        "engine": {"num_kv_blocks": 1024, "max_num_batched_tokens": 256},
        "prefill": {"num_replicas": 1, "num_cpus": 0.25},
        "decode": {"num_replicas": 1, "num_cpus": 0.25},
        "router": {"num_cpus": 0.25, "heartbeat_timeout_s": 5.0, "prefill_timeout_s": 10.0,
                   "offload_local_to_prefill": False,  # the forced-local load stays on the decode replica
                   "correction_half_life_s": 6.0, "transfer_cost_max_age_s": 24.0, "stale_after_s": 6.0},
        "transport": {"backend": "zmq", "host": "127.0.0.1"},
        "workloads": {"default": {"mode": "local"},
                      "adaptive": {"mode": "auto", "slo": {"ttft_ms": 600, "tpot_ms": 2_000}}},
        "faults": {"enabled": True},
    }


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_model_dir):
    from ray import serve

    from cluster.app import build_app

    serve.run(build_app(_config(tiny_model_dir)), name=APP, route_prefix="/")
    with httpx.Client(base_url=f"http://127.0.0.1:{ray_cluster['http_port']}", timeout=60) as client:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            r = client.get("/health")
            if r.status_code == 200 and r.json()["status"] == "ok":
                break
            time.sleep(0.5)
        yield client
    serve.delete(APP)


def _set_delay(seconds: float) -> None:
    from ray import serve

    serve.get_deployment_handle("PrefillWorker", APP).set_faults.remote(
        {"kv_layer_delay_s": seconds}).result(timeout_s=30)


def test_auto_shifts_away_from_a_slowed_kv_path_and_back(app):
    stop = threading.Event()
    rng = random.Random(11)

    def keep_decode_busy(seed: int) -> None:
        local = random.Random(seed)
        with httpx.Client(base_url=str(app.base_url), timeout=60) as c:
            while not stop.is_set():
                prompt = [local.randrange(250) for _ in range(1800)]
                c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})

    log: list[str] = []  # route, seconds, predicted TTFT ms, reason: printed with the routes

    def probe() -> str:
        prompt = [rng.randrange(250) for _ in range(200)]  # fresh: no replica has it cached
        sent = time.monotonic()
        r = app.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                     headers={"x-workload": "adaptive"})
        assert r.status_code == 200, r.text
        predicted = float(r.headers["x-pd-predicted-ttft-ms"])
        assert predicted > 0
        log.append(f"{r.headers['x-pd-route']} {time.monotonic() - sent:.2f}s {predicted:.0f}ms "
                   f"{r.headers['x-pd-reason']}")
        return r.headers["x-pd-route"]

    loaders = [threading.Thread(target=keep_decode_busy, args=(i,)) for i in range(3)]
    for t in loaders:
        t.start()
    try:
        time.sleep(1.0)
        before = [probe() for _ in range(10)]
        _set_delay(DELAY_S)
        during: list[str] = []
        started = time.monotonic()
        while time.monotonic() - started < MAX_FAULT_S and not (
                time.monotonic() - started > MIN_FAULT_S and during[-SETTLED:] == ["local"] * SETTLED):
            during.append(probe())
        _set_delay(0.0)
        cleared = time.monotonic()
        after: list[str] = []
        while "disagg" not in after[-4:] and time.monotonic() - cleared < 60:
            after.append(probe())
            time.sleep(0.3)
    finally:
        stop.set()
        for t in loaders:
            t.join(60)
    print(f"routes before {before}, during {during}, after ({time.monotonic() - cleared:.1f} s) {after}")
    print("probes (route, seconds, predicted TTFT, reason):", *log, sep="\n  ")
    assert before.count("disagg") >= 7, before
    assert during[-SETTLED:] == ["local"] * SETTLED, during
    assert during.count("disagg") <= MAX_REMOTE_UNDER_FAULT, during
    assert "disagg" in after[-4:], after


def test_a_prefill_replica_reports_a_transfer_still_waiting_for_its_acknowledgement(app):
    """Its heartbeat says how long a computed prompt's KV has waited on a slowed link, so
    the router prices that link slow before the transfer's record exists."""
    from ray import serve

    prefill = serve.get_deployment_handle("PrefillWorker", APP)
    _set_delay(1.5)  # the tiny model's two layers: 3 s
    sent = threading.Thread(target=lambda: app.post(
        "/v1/completions", json={"prompt": [7] * 64, "max_tokens": 2, "temperature": 0},
        headers={"x-pd-mode": "disagg"}))
    sent.start()
    waits: list[float] = []
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (waits and waits[-1] > 1.0):
            waits.append(max(prefill.stats.remote().result(timeout_s=30).get("transfer_waiting_s", {}).values(),
                             default=0.0))
            time.sleep(0.2)
    finally:
        _set_delay(0.0)
        sent.join(30)
    assert waits[-1] > 1.0, waits
    assert prefill.stats.remote().result(timeout_s=30)["transfer_waiting_s"] == {}  # acknowledged since
