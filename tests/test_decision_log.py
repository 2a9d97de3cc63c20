"""The router's decision log without Ray: bounded, oldest first, and each entry names
what the policy read and every candidate it priced."""

from __future__ import annotations

from cluster.config import SLO, RouterSettings, WorkloadProfile
from router.cluster_view import ClusterView, ReplicaInfo
from router.decision_log import DecisionLog
from router.learning import PolicyLearner
from router.metrics import RouterMetrics
from router.placement import PolicyInputs, place


def _view() -> ClusterView:
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([ReplicaInfo("d1", "decode", healthy=True, stats={}),
                 ReplicaInfo("p1", "prefill", healthy=True, stats={})])
    return view


def test_an_auto_decision_is_logged_with_every_candidate_and_what_was_read():
    view, log = _view(), DecisionLog(size=3)
    inputs = PolicyInputs("req-1", SLO(ttft_ms=2000, tpot_ms=50), now=1.0)
    placement = place(view, list(range(300)), 5, WorkloadProfile(mode="auto"), None, offload_to_prefill=False,
                      inputs=inputs, keep_context=True)
    log.record("req-1", "chat", placement, at=100.0)
    (entry,) = log.read()
    assert entry["request_id"] == "req-1" and entry["workload"] == "chat" and entry["at"] == 100.0
    assert (entry["prompt_len"], entry["max_tokens"]) == (300, 5)
    assert entry["route"] == placement.decision.route and entry["reason"] == placement.decision.reason
    kinds = [a["kind"] for a in entry["alternatives"]]
    assert "local" in kinds and "remote" in kinds and entry["kind"] in kinds
    assert all(a["ttft_ms"] > 0 and a["tpot_ms"] > 0 for a in entry["alternatives"])
    # the KV transfer's exposed tail: part of a remote candidate's TTFT, none of a local one's
    by_kind = {a["kind"]: a for a in entry["alternatives"]}
    assert 0 < by_kind["remote"]["transfer_ms"] < by_kind["remote"]["ttft_ms"]
    assert by_kind["local"]["transfer_ms"] == 0
    assert entry["decode"]["replica"] == "d1" and [p["replica"] for p in entry["prefills"]] == ["p1"]


def test_the_log_keeps_the_newest_oldest_first_and_clears():
    view, log = _view(), DecisionLog(size=3)
    for i in range(5):
        p = place(view, [i] * 40, 4, WorkloadProfile(mode="local"), None, offload_to_prefill=False,
                  keep_context=i % 2 == 0)
        log.record(f"r{i}", "default", p, at=float(i))
    assert [e["request_id"] for e in log.read()] == ["r2", "r3", "r4"]
    assert [e["request_id"] for e in log.read(limit=2)] == ["r3", "r4"]
    assert log.read(limit=0) == []
    assert log.read()[0]["alternatives"] == []  # a fixed rule prices one way only
    assert log.read()[1]["decode"] is None  # a placement that kept no context: nothing read to show
    log.clear()
    assert log.read() == []


def test_a_finished_request_shows_what_was_measured_beside_what_was_predicted():
    view, log = _view(), DecisionLog()
    inputs = PolicyInputs("req-1", SLO(ttft_ms=2000, tpot_ms=50), now=1.0)
    placement = place(view, list(range(300)), 5, WorkloadProfile(mode="auto"), None, offload_to_prefill=False,
                      inputs=inputs, keep_context=True)
    log.record("req-1", "chat", placement, at=100.0)
    (entry,) = log.read()
    shown = placement.decision.prediction
    assert entry["predicted_ttft_ms"] == round(shown.ttft_s * 1e3, 3) > 0
    assert entry["predicted_tpot_ms"] == round(shown.tpot_s * 1e3, 3) > 0
    assert entry["measured_ttft_ms"] is None and entry["measured_tpot_ms"] is None  # still running
    learner = PolicyLearner(RouterSettings(), RouterMetrics("m"), "router-1", clock=lambda: 2.0)
    learner.learn(placement, 0.25, 0.0125, transfer_tail_s=0.004)
    (entry,) = log.read()
    assert (entry["measured_ttft_ms"], entry["measured_tpot_ms"]) == (250.0, 12.5)
    assert entry["transfer_tail_ms"] == 4.0


def test_an_entry_is_stamped_when_it_was_decided_not_when_its_call_started():
    """The router records a request once its call has started (a TTFT later); `at` is the
    wall time of its placement, read through the policy's clock."""
    import time

    view, log = _view(), DecisionLog(clock=lambda: 31.0)
    inputs = PolicyInputs("req-1", SLO(ttft_ms=2000, tpot_ms=50), now=1.0)  # placed at 1.0 on the policy clock
    placement = place(view, list(range(300)), 5, WorkloadProfile(mode="auto"), None, offload_to_prefill=False,
                      inputs=inputs)
    log.record("req-1", "chat", placement)
    assert abs(log.read()[0]["at"] - (time.time() - 30.0)) < 1.0
