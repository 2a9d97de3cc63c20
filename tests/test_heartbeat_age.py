"""A heartbeat is up to a heartbeat period old when the router reads it, and older by the
time a request is placed: the replica kept computing its queue meanwhile. The view
takes off what it computed since (at the pace its queue drains, for at most
`MAX_HEARTBEAT_AGE_S`), from both the reported queue and this router's own backlog there.
Read as it was, a queue a heartbeat old made a remote prefill behind it look up to 1.5x
its measured TTFT on the bench, and taught the correction factors to shrink the next
prediction on an idle replica."""

from __future__ import annotations

import pytest

from router.candidate import Prediction
from router.cluster_view import MAX_HEARTBEAT_AGE_S, ClusterView, ReplicaInfo
from router.placement import Placement
from router.policy import RouteDecision
from workers.engine.cost_model import StepCoefficients

# a 100-token chunk costs 10 ms + 1 ms a token: 500 queued tokens drain in 5 steps, 0.55 s
MODEL = StepCoefficients(fixed_s=0.01, prefill_token_s=0.001, prefill_attention_s=0.0, decode_seq_s=0.0,
                         decode_context_s=0.0).to_dict()
REGISTRY_NOW = 1_796_000_000.0  # the registry stamps heartbeats with its own (wall) clock
POLICY_NOW = 50.0  # the router's policy clock (monotonic): another origin altogether


def _stats(waiting: int) -> dict:
    return {"step_model": MODEL, "max_num_batched_tokens": 100, "prompt_tokens_waiting": waiting,
            "prompt_attention_waiting": 0}


def _view(waiting: int, age_at_read: float, backlog: int = 0) -> tuple[ClusterView, ReplicaInfo]:
    view = ClusterView(16, 8)
    view.update([ReplicaInfo("d1", "decode"), ReplicaInfo("p1", "prefill", stats={})], POLICY_NOW, REGISTRY_NOW)
    if backlog:
        decision = RouteDecision("disagg", "slo-disagg", prediction=Prediction(1.0, 0.01))
        view.begin(Placement("decode", "d1", "p1", decision, 0, prefill_on="p1", prefill_tokens=backlog,
                             request_id="a"))
    p1 = ReplicaInfo("p1", "prefill", last_heartbeat=REGISTRY_NOW - age_at_read, stats=_stats(waiting))
    view.update([view.replicas["d1"], p1], POLICY_NOW, REGISTRY_NOW)
    return view, view.replicas["p1"]


def test_a_fresh_heartbeat_is_taken_as_it_is():
    view, p1 = _view(500, 0.0)
    assert view.load_of(p1, POLICY_NOW).queue_tokens == 500


def test_the_queue_drains_for_as_long_as_the_heartbeat_is_old():
    view, p1 = _view(500, 0.2)  # 0.2 s old when read, asked 0.075 s later: half the 0.55 s drain
    assert view.heartbeat_age("p1", POLICY_NOW + 0.075) == pytest.approx(0.275)
    assert view.load_of(p1, POLICY_NOW + 0.075).queue_tokens == 250
    assert view.load_of(p1, POLICY_NOW + 0.5).queue_tokens == 0  # all of it computed by now


def test_without_the_clocks_nothing_is_taken_off():
    view, p1 = _view(500, 0.2)
    assert view.load_of(p1).queue_tokens == 500  # no policy time: no age
    view.update([view.replicas["d1"], p1])  # a registry that gave no time
    assert view.heartbeat_age("p1", POLICY_NOW + 0.3) == 0.0
    assert view.load_of(p1, POLICY_NOW + 0.3).queue_tokens == 500


def test_a_heartbeat_long_unrenewed_drains_no_more_than_the_cap():
    view, p1 = _view(2000, 5.0)  # 2,000 tokens: 20 steps, 2.2 s
    assert view.heartbeat_age("p1", POLICY_NOW) == MAX_HEARTBEAT_AGE_S
    assert view.load_of(p1, POLICY_NOW).queue_tokens == round(2000 * (1 - MAX_HEARTBEAT_AGE_S / 2.2))


def test_this_routers_own_prompt_drains_too():
    """The backlog (each prompt whole until its first token) is the floor of the queue;
    it gives way to what the replica computed since as the reported queue does."""
    view, p1 = _view(500, 0.0, backlog=500)
    assert view.load_of(p1, POLICY_NOW).queue_tokens == 500
    assert view.load_of(p1, POLICY_NOW + 0.275).queue_tokens == 250


def test_a_prompt_sent_after_the_heartbeat_keeps_counting_whole():
    view, p1 = _view(500, 0.0)
    decision = RouteDecision("disagg", "slo-disagg", prediction=Prediction(1.0, 0.01))
    view.begin(Placement("decode", "d1", "p1", decision, 0, prefill_on="p1", prefill_tokens=300, request_id="b"))
    assert view.load_of(p1, POLICY_NOW + 0.275).queue_tokens == 250 + 300


def test_first_tokens_since_count_at_least_what_they_computed():
    """A prompt that got its first token since the heartbeat was computed whole, however
    little the drain pace says the replica got through."""
    view, p1 = _view(500, 0.0)
    decision = RouteDecision("disagg", "slo-disagg", prediction=Prediction(1.0, 0.01))
    placement = Placement("decode", "d1", "p1", decision, 0, prefill_on="p1", prefill_tokens=400, request_id="c")
    view.begin(placement)
    view.first_token(placement)
    assert view.load_of(p1, POLICY_NOW + 0.055).queue_tokens == 500 + 400 - 400  # not 500 + 400 - 50


def test_a_replica_slowed_by_its_busy_neighbour_drains_slower():
    """Its steps stretch beside the other busy replicas of its node (the step model's
    `node_contention`), and so does the pace its queue is taken to drain at."""
    view = ClusterView(16, 8)
    model = {**MODEL, "node_contention": 1.0}  # one busy neighbour: every step twice as long
    d1 = ReplicaInfo("d1", "decode", node_id="n1", stats={"num_running": 1})
    p1 = ReplicaInfo("p1", "prefill", node_id="n1", last_heartbeat=REGISTRY_NOW,
                     stats={**_stats(500), "step_model": model})
    view.update([d1, p1], POLICY_NOW, REGISTRY_NOW)
    assert view.load_of(view.replicas["p1"], POLICY_NOW + 0.275).queue_tokens == 375  # a quarter, not half


def _placed(view: ClusterView, rid: str, tokens: int, at: float) -> Placement:
    decision = RouteDecision("disagg", "slo-disagg", prediction=Prediction(1.0, 0.01))
    placement = Placement("decode", "d1", rid, decision, 0, prefill_on=rid, prefill_tokens=tokens,
                          placed_at=at, request_id=f"r{at}")
    view.begin(placement)
    return placement


def test_a_prompt_placed_on_an_idle_replica_is_computed_from_then_on():
    """Nothing was left to compute there: its first step starts at once, so a prompt
    placed behind it counts only what is left of it, not all of it until the next heartbeat."""
    view, p1 = _view(0, 0.0)
    _placed(view, "p1", 300, POLICY_NOW + 0.1)  # 3 steps of 0.11 s
    assert view.load_of(p1, POLICY_NOW + 0.1).queue_tokens == 300
    assert view.load_of(p1, POLICY_NOW + 0.265).queue_tokens == 150
    assert view.load_of(p1, POLICY_NOW + 0.5).queue_tokens == 0


def test_prompts_placed_behind_it_drain_after_it():
    view, p1 = _view(0, 0.0)
    _placed(view, "p1", 300, POLICY_NOW)
    _placed(view, "p1", 200, POLICY_NOW + 0.11)  # behind a third of the first: no new start
    assert view.load_of(p1, POLICY_NOW + 0.22).queue_tokens == 300  # 200 of the 500 computed


def test_a_read_between_two_prompts_changes_nothing():
    """The drain of what was sent since the replica woke is kept between reads: a prompt
    sent after a read is priced with it all the same."""
    view, p1 = _view(0, 0.0)
    _placed(view, "p1", 300, POLICY_NOW)
    assert view.load_of(p1, POLICY_NOW + 0.1).queue_tokens < 300
    _placed(view, "p1", 200, POLICY_NOW + 0.11)
    assert view.load_of(p1, POLICY_NOW + 0.22).queue_tokens == 300  # as read without the first read


def test_a_prompt_placed_on_a_busy_replica_starts_no_clock():
    view, p1 = _view(500, 0.0)
    _placed(view, "p1", 300, POLICY_NOW)
    assert view.load_of(p1, POLICY_NOW + 0.275).queue_tokens == 250 + 300  # the reported queue drains first


def test_the_next_heartbeat_takes_over_from_the_start():
    view, p1 = _view(0, 0.0)
    _placed(view, "p1", 300, POLICY_NOW)
    p1 = ReplicaInfo("p1", "prefill", last_heartbeat=REGISTRY_NOW + 0.2, stats=_stats(100))
    view.update([view.replicas["d1"], p1], POLICY_NOW + 0.2, REGISTRY_NOW + 0.2)
    assert view.load_of(view.replicas["p1"], POLICY_NOW + 0.2).queue_tokens == 300  # own backlog floors it


def test_a_background_prefill_starts_no_clock_and_stops_one():
    """It drains a small chunk a step: at the full-budget pace it would look done early."""
    view, p1 = _view(0, 0.0)
    decision = RouteDecision("local", "protect-streams", prediction=Prediction(1.0, 0.01), yield_prefill=True)
    view.begin(Placement("decode", "p1", "p1", decision, 0, prefill_on="p1", prefill_tokens=300,
                         placed_at=POLICY_NOW, request_id="bg"))
    assert view.load_of(p1, POLICY_NOW + 0.165).queue_tokens == 300
    view, p1 = _view(0, 0.0)
    _placed(view, "p1", 300, POLICY_NOW)
    view.begin(Placement("decode", "p1", "p1", decision, 0, prefill_on="p1", prefill_tokens=300,
                         placed_at=POLICY_NOW + 0.01, request_id="bg"))
    assert view.load_of(p1, POLICY_NOW + 0.165).queue_tokens == 600  # counted whole again until the heartbeat
