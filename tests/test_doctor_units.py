"""Pure units of `pdcluster doctor`: the metrics window and each symptom, triggered by a
synthetic sick deployment and silent on a healthy one. No server."""

from __future__ import annotations

import pytest

from cluster.doctor import symptoms as S
from cluster.doctor.evidence import Evidence
from cluster.doctor.window import from_texts
from cluster.loadtest.client import RequestRecord
from cluster.loadtest.prompt_blocks import prompt_block_hashes

L = 'model="m",pool="decode",replica="r1"'

# ---- window ------------------------------------------------------------------------------


def test_window_counter_and_histogram_deltas():
    start = (f"pdc_num_preemptions_total{{{L}}} 3\n"
             'pdc_requests_rejected_total{tenant="a",code="rate_limit_exceeded"} 1\n'
             'pdc_ttft_seconds_sum{route="disagg"} 2.0\n'
             'pdc_ttft_seconds_count{route="disagg"} 4\n')
    end = (f"pdc_num_preemptions_total{{{L}}} 8\n"
           'pdc_num_preemptions_total{model="m",pool="decode",replica="r2"} 2\n'  # new: counts from 0
           'pdc_requests_rejected_total{tenant="a",code="rate_limit_exceeded"} 4\n'
           'pdc_requests_rejected_total{tenant="b",code="server_overloaded"} 2\n'
           'pdc_ttft_seconds_sum{route="disagg"} 5.0\n'
           'pdc_ttft_seconds_count{route="disagg"} 10\n'
           'pdc_ttft_seconds_sum{route="local"} 1.0\n'
           'pdc_ttft_seconds_count{route="local"} 5\n')
    w = from_texts(start, end)
    assert w.counter("pdc_num_preemptions") == 7
    assert w.counter("pdc_num_preemptions", replica="r2") == 2
    assert w.counter("pdc_num_preemptions", pool="prefill") == 0
    assert w.counter("pdc_absent") == 0
    assert w.counter_by("pdc_requests_rejected", "tenant") == {"a": 3, "b": 2}
    assert w.counter_by("pdc_requests_rejected", "code") == {"rate_limit_exceeded": 3, "server_overloaded": 2}
    assert w.histogram("pdc_ttft_seconds") == (11, 4.0)
    assert w.histogram("pdc_ttft_seconds", route="disagg") == (6, 3.0)
    assert w.mean("pdc_ttft_seconds", route="local") == pytest.approx(0.2)
    assert w.mean("pdc_absent_seconds") is None
    assert w.histogram_by("pdc_ttft_seconds", "route") == {"disagg": (6, 3.0), "local": (5, 1.0)}


def test_window_counter_reset_is_not_negative():
    w = from_texts("pdc_x_total 10\n", "pdc_x_total 2\n")
    assert w.counter("pdc_x") == 0


def test_window_gauges_sum_over_matching_series():
    gauges = [(0.0, {"pdc_kv_blocks_free": [({"pool": "decode", "replica": "r1"}, 10.0),
                                            ({"pool": "decode", "replica": "r2"}, 5.0),
                                            ({"pool": "prefill", "replica": "p1"}, 7.0)]}),
              (0.5, {"pdc_other": [({}, 1.0)]}),
              (1.0, {"pdc_kv_blocks_free": [({"pool": "decode", "replica": "r1"}, 1.0)]})]
    w = from_texts("", "", gauges)
    assert w.gauge("pdc_kv_blocks_free", pool="decode") == [15.0, 1.0]
    assert w.gauge("pdc_kv_blocks_free") == [22.0, 1.0]
    assert w.gauge("pdc_absent") == []


# ---- helpers -----------------------------------------------------------------------------


def _rec(i: int, workload: str = "w", route: str | None = None, prompt_tokens: int | None = 100,
         ttft_s: float = 0.1, sent_at_s: float | None = None, e2e_s: float = 1.0, error_kind: str | None = None,
         reason: str | None = None, hashes: list[str] | None = None) -> RequestRecord:
    sent = float(i) if sent_at_s is None else sent_at_s
    ok = error_kind is None
    return RequestRecord(i, f"r{i}", workload, None, sent_at_s=sent, ended_at_s=sent + e2e_s,
                         ttft_s=ttft_s if ok else None, e2e_s=e2e_s if ok else None, completion_tokens=16,
                         prompt_tokens=prompt_tokens, route=route, reason=reason, error_kind=error_kind,
                         prompt_block_hashes=hashes or [])


def _gauges(*samples: dict[str, list[tuple[dict, float]]]):
    return [(float(t), fams) for t, fams in enumerate(samples)]


def _window(end: str = "", start: str = "", gauges=None):
    return from_texts(start, end, gauges)


def _symptoms(findings) -> list[str]:
    return [f.symptom for f in findings]


BODY = "".join(f"The shared instructions, line {i:03d}. " for i in range(20))[:600]
assert len(BODY.encode()) == 600


def _dynamic_first(n: int = 10) -> list[RequestRecord]:
    return [_rec(i, hashes=prompt_block_hashes(f"id={i:012d};" + BODY)) for i in range(n)]


def _stable_first(n: int = 10) -> list[RequestRecord]:
    return [_rec(i, hashes=prompt_block_hashes(BODY + f"#{i:03d}" * 8)) for i in range(n)]


# ---- prefix --------------------------------------------------------------------------------


def test_prefix_structure_shares():
    assert S.prefix_structure([]) == (0.0, 0.0, 0)
    reusable, shared, blocks = S.prefix_structure(_dynamic_first(10))
    assert blocks == 10 * 38
    assert reusable == pytest.approx(9 * 37 / 380)  # every body block after the first request
    assert shared == 0.0  # the unique head breaks every prefix
    reusable, shared, blocks = S.prefix_structure(_stable_first(10))
    assert blocks == 10 * 39
    assert shared == pytest.approx(9 * 37 / 390)  # the body's full blocks are a shared prefix
    assert reusable == pytest.approx(shared)
    # order is by send time, not list order
    recs = _dynamic_first(2)
    assert S.prefix_structure(recs) == S.prefix_structure(recs[::-1])


def test_prefix_dynamic_first():
    found = S.prefix_dynamic_first(Evidence(records=_dynamic_first()))
    assert _symptoms(found) == ["prefix-dynamic-first"]
    assert found[0].workload == "w" and found[0].numbers["prefix_block_share"] == 0.0
    assert S.prefix_dynamic_first(Evidence(records=_stable_first())) == []
    assert S.prefix_dynamic_first(Evidence(records=_dynamic_first(4))) == []  # too few requests
    # the cache hits anyway (e.g. it matches more than prefixes): nothing to fix
    hits = _window("pdc_prefix_cache_queries_total 100\npdc_prefix_cache_hits_total 60\n")
    assert S.prefix_dynamic_first(Evidence(window=hits, records=_dynamic_first())) == []


# ---- KV ----------------------------------------------------------------------------------------


def _kv(free: float, total: float = 100.0, pool: str = "decode"):
    labels = {"pool": pool, "replica": "r1"}
    return {"pdc_kv_blocks_free": [(labels, free)], "pdc_kv_blocks_total": [(labels, total)]}


def test_kv_pressure():
    preempted = _window(start=f"pdc_num_preemptions_total{{{L}}} 3\n", end=f"pdc_num_preemptions_total{{{L}}} 6\n",
                        gauges=_gauges(_kv(50), _kv(40)))
    found = S.kv_pressure(Evidence(window=preempted))
    assert _symptoms(found) == ["kv-pressure"] and found[0].numbers["preemptions"] == 3
    full = _window(gauges=_gauges(_kv(50), _kv(2)))
    found = S.kv_pressure(Evidence(window=full))
    assert _symptoms(found) == ["kv-pressure"]
    assert found[0].numbers["min_free_share"] == 0.02 and found[0].numbers["pool"] == "decode"
    healthy = _window(start=f"pdc_num_preemptions_total{{{L}}} 3\n", end=f"pdc_num_preemptions_total{{{L}}} 3\n",
                      gauges=_gauges(_kv(50), _kv(30), {**_kv(60, pool="prefill")}))
    assert S.kv_pressure(Evidence(window=healthy)) == []
    assert S.kv_pressure(Evidence()) == []


# ---- routes --------------------------------------------------------------------------------


def _routes(disagg_ttft: float, local_ttft: float) -> list[RequestRecord]:
    out = []
    for i in range(8):
        out.append(_rec(2 * i, route="disagg", prompt_tokens=400 + 10 * i, ttft_s=disagg_ttft))
        out.append(_rec(2 * i + 1, route="local", prompt_tokens=400 + 10 * i, ttft_s=local_ttft))
    return out


def test_disagg_slower_from_records():
    found = S.disagg_slower(Evidence(records=_routes(0.3, 0.1)))
    assert _symptoms(found) == ["disagg-slower"]
    assert found[0].numbers["ttft_ratio"] == pytest.approx(3.0) and found[0].workload == "w"
    assert S.disagg_slower(Evidence(records=_routes(0.11, 0.1))) == []
    # each workload forced to one route: compared over the whole run
    split = [_rec(r.index, workload="a" if r.route == "disagg" else "b", route=r.route,
                  prompt_tokens=r.prompt_tokens, ttft_s=r.ttft_s) for r in _routes(0.3, 0.1)]
    assert [f.workload for f in S.disagg_slower(Evidence(records=split))] == ["(all workloads)"]


def _ttft_hist(workload: str, route: str, count: int, total: float) -> str:
    labels = f'workload="{workload}",route="{route}"'
    return (f"pdc_time_to_first_token_seconds_sum{{{labels}}} {total}\n"
            f"pdc_time_to_first_token_seconds_count{{{labels}}} {count}\n")


def test_disagg_slower_from_metrics():
    slow = _window(_ttft_hist("w", "disagg", 10, 4.0) + _ttft_hist("w", "local", 10, 1.0))
    found = S.disagg_slower(Evidence(window=slow))
    assert _symptoms(found) == ["disagg-slower"] and found[0].numbers["ttft_ratio"] == pytest.approx(4.0)
    fine = _window(_ttft_hist("w", "disagg", 10, 1.2) + _ttft_hist("w", "local", 10, 1.0))
    assert S.disagg_slower(Evidence(window=fine)) == []


def test_short_prompts_disaggregated():
    short = [_rec(i, route="disagg", prompt_tokens=40) for i in range(6)]
    found = S.short_prompts_disaggregated(Evidence(records=short))
    assert _symptoms(found) == ["short-prompts-disaggregated"] and found[0].numbers["limit_tokens"] == 256
    # the profile's own limit is used
    assert S.short_prompts_disaggregated(
        Evidence(records=short, profiles={"default": {"min_remote_prefill_tokens": 32}})) == []
    # `auto` chose them on its predictions: not misrouted
    predicted = [_rec(i, route="disagg", prompt_tokens=40, reason="slo-ttft") for i in range(6)]
    assert S.short_prompts_disaggregated(Evidence(records=predicted)) == []
    long = [_rec(i, route="disagg", prompt_tokens=2000) for i in range(6)]
    assert S.short_prompts_disaggregated(Evidence(records=long)) == []


def _crowd(prompt_tokens: int) -> list[RequestRecord]:
    # three streams decoding from t=0.1 to 10, then long local prompts arriving among them
    streams = [_rec(i, route="disagg", prompt_tokens=50, sent_at_s=0.0, ttft_s=0.1, e2e_s=10.0) for i in range(3)]
    arrivals = [_rec(3 + i, route="local", prompt_tokens=prompt_tokens, sent_at_s=1.0 + i, ttft_s=0.5, e2e_s=0.6)
                for i in range(4)]
    return streams + arrivals


def test_long_prompts_beside_streams():
    found = S.long_prompts_beside_streams(Evidence(records=_crowd(2000)))
    assert _symptoms(found) == ["long-prompts-beside-streams"] and found[0].numbers["crowded"] == 4
    assert S.long_prompts_beside_streams(Evidence(records=_crowd(100))) == []
    alone = [_rec(i, route="local", prompt_tokens=2000, sent_at_s=10.0 * i, e2e_s=1.0) for i in range(5)]
    assert S.long_prompts_beside_streams(Evidence(records=alone)) == []


# ---- pools ----------------------------------------------------------------------------------


def _pools(prefill_waiting: float, prefill_running: float, decode_waiting: float, decode_running: float):
    p, d = {"pool": "prefill", "replica": "p1"}, {"pool": "decode", "replica": "d1"}
    fams = {"pdc_num_requests_waiting": [(p, prefill_waiting), (d, decode_waiting)],
            "pdc_num_requests_running": [(p, prefill_running), (d, decode_running)]}
    return _window(gauges=_gauges(fams, fams, fams))


def _step_seconds(pool: str, cpu: float, run_wait: float) -> str:
    return "".join(f'pdc_engine_step_seconds_total{{model="m",pool="{pool}",part="{part}"}} {v}\n'
                   for part, v in (("cpu", cpu), ("run_wait", run_wait), ("wall", cpu + run_wait)))


def test_crowded_node():
    """A pool whose engine threads waited a quarter of their CPU time for a core; not one
    that waited less, nor a window with too little computing to judge."""
    crowded = S.crowded_node(Evidence(window=_window(_step_seconds("decode", 8.0, 3.0)
                                                     + _step_seconds("prefill", 8.0, 0.5))))
    assert _symptoms(crowded) == ["crowded-node"]
    assert crowded[0].numbers["pools"]["decode"]["wait_share"] == pytest.approx(0.375)
    assert "decode engines waited 3.0 s" in crowded[0].evidence and "prefill engines" not in crowded[0].evidence
    assert S.crowded_node(Evidence(window=_window(_step_seconds("decode", 8.0, 1.6)))) == []
    assert S.crowded_node(Evidence(window=_window(_step_seconds("decode", 0.5, 0.5)))) == []
    assert S.crowded_node(Evidence()) == []


def test_pool_imbalance():
    found = S.pool_imbalance(Evidence(window=_pools(4, 2, 0, 1)))
    assert _symptoms(found) == ["prefill-saturated"]
    assert found[0].numbers["replicas"] == {"prefill": 1, "decode": 1}
    assert _symptoms(S.pool_imbalance(Evidence(window=_pools(0, 0, 5, 16)))) == ["decode-saturated"]
    assert S.pool_imbalance(Evidence(window=_pools(0, 1, 0, 4))) == []
    assert S.pool_imbalance(Evidence(window=_pools(4, 2, 3, 12))) == []  # both pools wait: no single culprit


def _routed(reasons: dict[str, int], decode_waiting: float = 0.0):
    p, d = {"pool": "prefill", "replica": "p1"}, {"pool": "decode", "replica": "d1"}
    fams = {"pdc_num_requests_waiting": [(p, 0.0), (d, decode_waiting)],
            "pdc_num_requests_running": [(p, 1.0), (d, 2.0)]}
    text = "".join(f'pdc_route_decisions_total{{model="m",route="local",reason="{r}",workload="w"}} {n}\n'
                   for r, n in reasons.items())
    return _window(text, gauges=_gauges(fams, fams))


def test_pool_imbalance_from_requests_routed_around_a_busy_pool():
    spilled = S.pool_imbalance(Evidence(window=_routed({"prefill-busy": 6, "long-prompt": 4})))
    assert _symptoms(spilled) == ["prefill-saturated"]
    assert spilled[0].numbers["routed_around"]["prefill"] == pytest.approx(0.6)
    assert _symptoms(S.pool_imbalance(Evidence(window=_routed({"decode-busy": 5, "short-prompt": 5})))) \
        == ["decode-saturated"]
    # both busy: the pool routed around at least twice as often is named, else none
    assert _symptoms(S.pool_imbalance(Evidence(window=_routed({"prefill-busy": 6, "long-prompt": 4}, 2.0)))) \
        == ["prefill-saturated"]
    assert S.pool_imbalance(Evidence(window=_routed({"prefill-busy": 3, "decode-busy": 2, "x": 5}, 2.0))) == []
    assert S.pool_imbalance(Evidence(window=_routed({"prefill-busy": 1, "long-prompt": 9}))) == []
    assert S.pool_imbalance(Evidence(window=_window(gauges=_gauges({})))) == []  # one sample: no judgment


# ---- latency shares ----------------------------------------------------------------------


def test_transfer_dominates():
    ttft = _ttft_hist("w", "disagg", 10, 2.0)  # 200 ms mean
    slow = _window(ttft + "pdc_kv_transfer_seconds_sum 1.6\npdc_kv_transfer_seconds_count 10\n")
    found = S.transfer_dominates(Evidence(window=slow))
    assert _symptoms(found) == ["transfer-dominates-ttft"] and found[0].numbers["share"] == pytest.approx(0.8)
    fast = _window(ttft + "pdc_kv_transfer_seconds_sum 0.5\npdc_kv_transfer_seconds_count 10\n")
    assert S.transfer_dominates(Evidence(window=fast)) == []
    assert S.transfer_dominates(Evidence(window=_window(ttft))) == []  # no transfers measured


def _queue(stage: str, count: int, total: float) -> str:
    return (f'pdc_request_queue_seconds_sum{{stage="{stage}"}} {total}\n'
            f'pdc_request_queue_seconds_count{{stage="{stage}"}} {count}\n')


def test_queueing_dominates():
    ttft = _ttft_hist("w", "local", 10, 2.0)  # 200 ms mean
    queued = _window(ttft + _queue("admission", 10, 1.0) + _queue("engine", 10, 0.2))
    found = S.queueing_dominates(Evidence(window=queued))
    assert _symptoms(found) == ["queueing-dominates-ttft"]
    assert found[0].numbers["share"] == pytest.approx(0.6)
    assert found[0].numbers["by_stage_ms"] == {"admission": 100.0, "engine": 20.0}
    light = _window(ttft + _queue("admission", 10, 0.1) + _queue("engine", 10, 0.2))
    assert S.queueing_dominates(Evidence(window=light)) == []


# ---- failures --------------------------------------------------------------------------------


def test_timeouts():
    window = _window("pdc_route_decisions_total 100\n"
                     'pdc_request_timeouts_total{tenant="t1",workload="w"} 3\n')
    found = S.timeouts(Evidence(window=window))
    assert _symptoms(found) == ["timeouts"] and found[0].numbers["by_tenant"] == {"t1": 3}
    records = [_rec(i) for i in range(20)] + [_rec(20, error_kind="timeout")]
    assert _symptoms(S.timeouts(Evidence(records=records))) == ["timeouts"]
    assert S.timeouts(Evidence(window=_window("pdc_route_decisions_total 100\n"))) == []
    assert S.timeouts(Evidence(records=[_rec(i) for i in range(20)])) == []


def test_rejections():
    window = _window("pdc_route_decisions_total 100\n"
                     'pdc_requests_rejected_total{tenant="t1",code="rate_limit_exceeded"} 5\n')
    found = S.rejections(Evidence(window=window))
    assert _symptoms(found) == ["rejections"]
    assert found[0].numbers["by_code"] == {"rate_limit_exceeded": 5}
    records = [_rec(i) for i in range(20)] + [_rec(20 + i, error_kind="http_429") for i in range(3)]
    assert _symptoms(S.rejections(Evidence(records=records))) == ["rejections"]
    assert S.rejections(Evidence(window=_window("pdc_route_decisions_total 100\n"))) == []


def test_prefill_pool_down():
    down = {"status": "degraded", "pools": {"prefill": {"status": "down", "replicas": 0},
                                            "decode": {"status": "ok"}}}
    assert _symptoms(S.prefill_pool_down(Evidence(health=down))) == ["prefill-pool-down"]
    up = {"status": "ok", "pools": {"prefill": {"status": "ok"}, "decode": {"status": "ok"}}}
    assert S.prefill_pool_down(Evidence(health=up)) == []
    assert S.prefill_pool_down(Evidence()) == []


# ---- the whole diagnosis -------------------------------------------------------------------


def _healthy() -> Evidence:
    end = (f"pdc_num_preemptions_total{{{L}}} 0\n"
           "pdc_route_decisions_total 40\n"
           "pdc_prefix_cache_queries_total 100\npdc_prefix_cache_hits_total 50\n"
           + _ttft_hist("w", "disagg", 20, 4.0) + _ttft_hist("w", "local", 20, 3.6)
           + "pdc_kv_transfer_seconds_sum 1.0\npdc_kv_transfer_seconds_count 20\n"
           + _queue("admission", 40, 0.4) + _queue("engine", 40, 0.4))
    p, d = {"pool": "prefill", "replica": "p1"}, {"pool": "decode", "replica": "d1"}
    sample = {"pdc_num_requests_waiting": [(p, 0.0), (d, 0.0)], "pdc_num_requests_running": [(p, 1.0), (d, 4.0)],
              "pdc_kv_blocks_free": [(p, 80.0), (d, 60.0)], "pdc_kv_blocks_total": [(p, 100.0), (d, 100.0)]}
    records = _stable_first(10)
    for r in records:
        r.route, r.prompt_tokens = "disagg", 600
    records += [_rec(10 + i, route="local", prompt_tokens=100, sent_at_s=20.0 + 2 * i) for i in range(6)]
    health = {"status": "ok", "pools": {"prefill": {"status": "ok"}, "decode": {"status": "ok"}}}
    return Evidence(window=from_texts("", end, _gauges(sample, sample, sample)), health=health,
                    profiles={"default": {"mode": "auto"}}, engine={"max_num_seqs": 16}, records=records)


def test_diagnose_is_silent_on_a_healthy_deployment():
    assert S.diagnose(_healthy()) == []
    assert S.diagnose(Evidence()) == []


def test_every_symptom_has_a_check():
    sick = [
        Evidence(records=_dynamic_first()),
        Evidence(window=_window(gauges=_gauges(_kv(1)))),
        Evidence(records=_routes(0.3, 0.1)),
        Evidence(records=[_rec(i, route="disagg", prompt_tokens=40) for i in range(6)]),
        Evidence(records=_crowd(2000)),
        Evidence(window=_pools(4, 2, 0, 1)),
        Evidence(window=_pools(0, 0, 5, 16)),
        Evidence(window=_window(_step_seconds("decode", cpu=10.0, run_wait=4.0))),
        Evidence(window=_window(_ttft_hist("w", "disagg", 10, 2.0)
                                + "pdc_kv_transfer_seconds_sum 1.6\npdc_kv_transfer_seconds_count 10\n")),
        Evidence(window=_window(_ttft_hist("w", "local", 10, 2.0) + _queue("admission", 10, 1.5))),
        Evidence(records=[_rec(i, error_kind="timeout") for i in range(3)]),
        Evidence(records=[_rec(i, error_kind="http_429") for i in range(3)]),
        Evidence(health={"status": "degraded", "pools": {"prefill": {"status": "down"}}}),
    ]
    seen = {f.symptom for ev in sick for f in S.diagnose(ev)}
    assert seen == set(S.SYMPTOMS)
    assert all(f.to_json()["fix"] for ev in sick for f in S.diagnose(ev))
