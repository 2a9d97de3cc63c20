"""A prompt partly computed counts, in the router's view of its replica's queue, for what
is left of it: the heartbeat names it (`prefill_progress`), and the router's own backlog,
which counts each prompt whole until its first token, gives way to that."""

from __future__ import annotations

from router.candidate import Prediction
from router.cluster_view import ClusterView, ReplicaInfo
from router.placement import Placement
from router.policy import RouteDecision
from router.replica_load import from_stats
from workers.engine.request_ids import engine_request_id, origin_request_id

_PREDICTED = Prediction(1.0, 0.01)


def _view(stats: dict, heartbeat: float = 1.0) -> ClusterView:
    view = ClusterView(16, 8)
    view.update([ReplicaInfo("d1", "decode"), ReplicaInfo("p1", "prefill", last_heartbeat=heartbeat, stats=stats)])
    return view


def _placed(request_id: str, tokens: int, work: int, background: bool = False) -> Placement:
    if background:  # on a replica that decodes too
        decision = RouteDecision("local", "protect-streams", yield_prefill=True, prediction=_PREDICTED)
        return Placement("decode", "p1", None, decision, 0, prefill_on="p1", prefill_tokens=tokens,
                         prefill_work=work, request_id=request_id)
    decision = RouteDecision("disagg", "slo-disagg", prediction=_PREDICTED)
    return Placement("decode", "d1", "p1", decision, 0, prefill_on="p1", prefill_tokens=tokens,
                     prefill_work=work, request_id=request_id)


def test_engine_ids_lead_back_to_the_id_the_request_came_with():
    assert origin_request_id(engine_request_id("abc-1")) == "abc-1"
    assert origin_request_id(engine_request_id("has#hash")) == "has#hash"
    assert origin_request_id("plain") == "plain" and origin_request_id("x#y") == "x#y"


def test_a_partly_computed_prompt_counts_for_what_is_left():
    view = _view({})
    a, b = _placed("a", 1000, 500_000), _placed("b", 600, 180_000)
    for p in (a, b):
        view.begin(p)
    p1 = view.replicas["p1"]
    assert view.load_of(p1).queue_tokens == 1600  # nothing reported yet: both whole
    # the next heartbeat: a is 900 tokens in, b has not started
    view.update([view.replicas["d1"], ReplicaInfo("p1", "prefill", last_heartbeat=2.0, stats={
        "prompt_tokens_waiting": 700, "prompt_attention_waiting": 90_000 + 180_000,
        "prefill_progress": {engine_request_id("a"): [100, 90_000]}})])
    load = view.load_of(view.replicas["p1"])
    assert (load.queue_tokens, load.queue_work) == (700, 270_000)


def test_a_prompt_the_heartbeat_has_not_seen_still_counts_whole():
    """Sent before the heartbeat was taken but not yet there: the backlog keeps it."""
    view = _view({})
    a, b = _placed("a", 1000, 500_000), _placed("b", 600, 180_000)
    for p in (a, b):
        view.begin(p)
    view.update([view.replicas["d1"], ReplicaInfo("p1", "prefill", last_heartbeat=2.0, stats={
        "prompt_tokens_waiting": 100, "prompt_attention_waiting": 90_000,
        "prefill_progress": {engine_request_id("a"): [100, 90_000]}})])
    assert view.load_of(view.replicas["p1"]).queue_tokens == 100 + 600


def test_a_background_prefills_progress_counts_in_its_own_lane_too():
    view = _view({})
    bg = _placed("bg", 800, 300_000, background=True)
    view.begin(bg)
    view.update([view.replicas["d1"], ReplicaInfo("p1", "prefill", last_heartbeat=2.0, stats={
        "prompt_tokens_waiting": 300, "background_tokens_waiting": 300,
        "prefill_progress": {engine_request_id("bg"): [300, 100_000]}})])
    load = view.load_of(view.replicas["p1"])
    assert (load.queue_tokens, load.background_tokens, load.background_work) == (300, 300, 100_000)


def test_a_malformed_progress_report_is_ignored():
    assert from_stats("p1", "prefill", {"prefill_progress": {"a#1": [1]}}).prefill_progress == {}
    assert from_stats("p1", "prefill", {"prefill_progress": "junk"}).prefill_progress == {}
    assert from_stats("p1", "prefill", {"prefill_progress": {"a#7": [3, 9]}}).prefill_progress == {"a": (3, 9)}
