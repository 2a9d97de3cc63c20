"""How the router explains its routes over HTTP, on the app of
tests/router_http/support.py: every response's predicted TTFT and TPOT in every mode, the
SLO reasons of `auto`, and the admin endpoints that show the replicas' step and transfer
records, the learned models and corrections (and their reset), and each decision with
every candidate priced.
"""

from __future__ import annotations

import time

import pytest

from tests.router_http.support import TOKEN, assert_openai_error, complete


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
    assert policy["stalled_links"] == {}, policy  # no transfer stalled on these links
    entry = next(iter(next(iter(learned.values()))["corrections"].values()))
    assert entry["factor"] > 0 and entry["num_samples"] >= 1 and entry["updated_at"] > 0
    assert any("*" in t for t in transfers if t), transfers
    assert policy["settings"]["default_slo"] == {"ttft_ms": 2000.0, "tpot_ms": 200.0}
    errors = policy["prediction_error"]  # the answering replica's: it learned, so it measured
    assert errors and all(b["ttft_bias"] > 0 and b["ttft_samples"] >= 1 for b in errors.values()), errors
    # the hop to each replica the router called: its TTFT beyond the worker's own
    assert 0 <= policy["hop_s"] < 5 and any(r.get("hop_s") is not None for r in learned.values()), policy
    reset = client.post("/admin/policy/reset", headers=auth).json()
    assert reset["reset_at"] is not None
    assert not any(r.get("corrections") for r in reset["replicas"].values()), reset
    assert reset["hop_s"] is not None or reset["router"] != policy["router"], reset  # the path, not a model


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
    assert 0 < d["worker_ttft_ms"] <= d["measured_ttft_ms"], d  # the worker's span is inside the router's
    tail = d["transfer_tail_ms"]
    if d["route"] == "local":
        assert tail is None, d
    elif tail is not None:  # a remote prompt's transfer tail, where its stream said it before ending
        assert 0 <= tail <= d["measured_ttft_ms"], d
    kinds = {a["kind"] for a in d["alternatives"]}
    assert d["kind"] in kinds and {"local", "remote"} <= kinds
    assert all(a["ttft_ms"] > 0 and isinstance(a["meets"], bool) for a in d["alternatives"])
    assert d["prefills"]
    if d["kind"] == "whole":  # the request runs whole on an idle prefill replica: it decodes there
        assert d["decode_replica"] == d["prefill_replica"] in {p["replica"] for p in d["prefills"]}
    else:
        assert d["decode"]["replica"] == d["decode_replica"]
