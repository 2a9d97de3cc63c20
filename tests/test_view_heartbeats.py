"""The view takes in each poll's heartbeats as they come: it parses every one there, so
no routing decision parses one, keeps a parse while a replica's heartbeat stays the same,
and placement ranks a pool by load as `heapq.nsmallest` does."""

from __future__ import annotations

import heapq
import random

import router.heartbeat_parses as heartbeat_parses
from router.cluster_view import ClusterView, ReplicaInfo
from router.placement import least_loaded
from workers.engine.cost_model import StepCoefficients

STEP_MODEL = StepCoefficients(0.01, 1e-4, 0.0, 1e-4, 0.0, num_samples=4).to_dict()


def _replicas(waiting: int = 0) -> list[ReplicaInfo]:
    stats = {"step_model": STEP_MODEL, "num_running": 1, "num_waiting": waiting, "prompt_tokens_waiting": 100 * waiting}
    return [ReplicaInfo("d1", "decode", stats=dict(stats)), ReplicaInfo("p1", "prefill", address="tcp://p1",
                                                                          stats=dict(stats))]


def _counting_parses(monkeypatch) -> list[str]:
    parsed: list[str] = []
    real = heartbeat_parses.from_stats

    def counting(replica_id, *args, **kwargs):
        parsed.append(replica_id)
        return real(replica_id, *args, **kwargs)

    monkeypatch.setattr(heartbeat_parses, "from_stats", counting)
    return parsed


def test_update_parses_each_heartbeat_and_a_decision_parses_none(monkeypatch):
    parsed = _counting_parses(monkeypatch)
    view = ClusterView(16, 8)
    view.update(_replicas())
    assert sorted(parsed) == ["d1", "p1"]
    for replica in view.replicas.values():
        view.load_of(replica, 0.0)
        view.load_of(replica, 0.5, recent_prompts=True, arrival_objectives=True)
    assert sorted(parsed) == ["d1", "p1"]  # read from the parse update made
    assert view.heartbeat_load(view.replicas["d1"]).queue_tokens == 0


def test_the_same_heartbeat_polled_again_keeps_its_parse_and_a_new_one_is_parsed(monkeypatch):
    parsed = _counting_parses(monkeypatch)
    view = ClusterView(16, 8)
    view.update(_replicas())
    first = view.heartbeat_load(view.replicas["p1"])
    view.update(_replicas())  # new objects, equal stats: the registry's last heartbeat again
    assert len(parsed) == 2 and view.heartbeat_load(view.replicas["p1"]) is first
    view.update(_replicas(waiting=3))
    assert len(parsed) == 4
    assert view.heartbeat_load(view.replicas["p1"]).queue_tokens == 300


def test_a_replica_that_moved_keeps_no_parse_of_its_old_address(monkeypatch):
    parsed = _counting_parses(monkeypatch)
    view = ClusterView(16, 8)
    view.update(_replicas())
    moved = _replicas()
    moved[1].address = "tcp://p1-restarted"
    view.update(moved)
    assert len(parsed) == 3 and view.heartbeat_load(view.replicas["p1"]).address == "tcp://p1-restarted"


def testleast_loaded_ranks_as_nsmallest_by_load_ties_in_pool_order():
    rng = random.Random(3)
    for _ in range(200):
        pool = [ReplicaInfo(f"r{i}", "prefill", stats={"num_running": rng.randint(0, 3)}) for i in range(12)]
        view = ClusterView(16, 8)
        view.update(pool)
        for r in rng.sample(pool, 4):
            view.inflight[r.replica_id] += rng.randint(0, 5)
        k = rng.randint(1, 6)
        assert least_loaded(view, view.healthy("prefill"), k) == heapq.nsmallest(k, view.healthy("prefill"),
                                                                              key=view.load)


def test_a_heartbeat_that_cannot_be_read_leaves_the_others_taken_in(caplog):
    view = ClusterView(16, 8)
    for _ in range(3):
        replicas = _replicas()
        replicas[0].stats["step_model"] = {**STEP_MODEL, "c9": 1.0}  # a field this version does not know
        view.update(replicas)  # does not raise: the poll goes on
    assert view.heartbeat_load(view.replicas["p1"]).role == "prefill"
    assert [r.replica_id for r in view.healthy("decode")] == ["d1"]
    assert sum("d1" in r.getMessage() for r in caplog.records) == 1  # said once, not every poll
