"""The prompts a long foreground prefill makes late (`router/arrivals.py`): the closed
form against a walk over arrival times, the window, the view's bookkeeping, and the
decision it changes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.config import SLO
from router.arrivals import RecentArrivals, late_arrivals
from router.routing import decide
from tests.test_auto_policy import ctx, replica


@settings(max_examples=100, deadline=None)
@given(slacks=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=30), hold=st.floats(0.0, 4.0))
def test_the_closed_form_is_the_mean_over_arrival_times_of_those_late(slacks, hold):
    """Each recent arrival, shifted uniformly over the hold: late when the rest of the hold
    exceeds its slack. Averaged over 2,000 arrival times, times the rate."""
    window = 10.0
    times = [hold * (i + 0.5) / 2000 for i in range(2000)]
    walked = sum(sum(1 for t in times if hold - t > s) / len(times) * hold for s in slacks) / window
    assert late_arrivals(tuple(sorted(slacks)), window, hold) == pytest.approx(walked, abs=2e-3 * len(slacks))


def test_nothing_is_late_behind_nothing_or_with_room_to_spare():
    assert late_arrivals((), 10.0, 2.0) == 0.0
    assert late_arrivals((0.5, 1.0), 10.0, 0.0) == 0.0
    assert late_arrivals((2.5, 3.0), 10.0, 2.0) == 0.0
    # 40 arrivals in 10 s with 85 ms to spare, behind 1.5 s: about 5.7 late
    assert late_arrivals((0.085,) * 40, 10.0, 1.5) == pytest.approx(40 * (1.5 - 0.085) / 10)


def test_the_window_forgets_old_arrivals_and_gone_replicas():
    arrivals = RecentArrivals(window_s=10.0)
    arrivals.add("d1", 0.0, 0.2)
    arrivals.add("d1", 5.0, 0.1)
    arrivals.add("d1", 6.0, -0.3)  # already late when placed: no slack
    assert arrivals.slacks("d1", 9.0) == (0.0, 0.1, 0.2)
    assert arrivals.slacks("d1", 12.0) == (0.0, 0.1)
    arrivals.add("d1", 12.5, 0.05)
    assert arrivals.slacks("d1", 12.5) == (0.0, 0.05, 0.1)
    arrivals.forget({"d2"})
    assert arrivals.slacks("d1", 12.5) == ()


def test_the_view_records_each_foreground_prompt_with_its_slack():
    from router.cluster_view import ClusterView, ReplicaInfo
    from router.placement import Placement
    from router.policy import RouteDecision
    from router.predict import Candidate, Prediction

    view = ClusterView(16, 8)
    d1 = ReplicaInfo("d1", "decode")
    view.update([d1])

    def placed(at: float, ttft_s: float, background: bool = False) -> Placement:
        kind = "background" if background else "local"
        chosen = Candidate(kind, "d1", "d1", Prediction(ttft_s, 0.02))
        decision = RouteDecision("local", "slo-local", yield_prefill=background, candidate=chosen,
                                 prediction=chosen.prediction)
        return Placement("decode", "d1", None, decision, 0, prefill_on="d1", prefill_tokens=100,
                         ttft_slo_s=0.2, placed_at=at)

    view.begin(placed(1.0, 0.12))
    view.begin(placed(2.0, 0.05))
    view.begin(placed(3.0, 0.5, background=True))  # yields to the foreground: delays no one
    assert view.load_of(d1, now=4.0).arrival_slacks_s == pytest.approx((0.08, 0.15))
    assert view.load_of(d1).arrival_slacks_s == ()  # without the policy's clock


def test_a_long_prompt_leaves_the_foreground_of_a_replica_where_short_prompts_keep_arriving():
    """A decision from `bench cluster`'s tight_ttft cell: a 1,496-token prompt whose every
    route meets its objective, on a decode replica where short prompts arrive at 4/s with
    about 85 ms to spare. The foreground prefill there was the quickest and was taken; the
    next seven short prompts queued behind it and were late. With the arrivals counted it
    goes where it delays none of them; with none arriving, the quickest route still wins."""
    slo = SLO(ttft_ms=2393, tpot_ms=134)
    quiet = decide(ctx(prompt_len=1496, slo=slo))
    assert quiet.candidate.kind == "local" and all(a.meets for a in quiet.alternatives)
    busy = replica("d1", arrival_slacks_s=(0.085,) * 40, arrival_window_s=10.0)
    decision = decide(ctx(prompt_len=1496, slo=slo, decode=busy))
    assert decision.candidate.kind == "remote"
    local = next(a for a in decision.alternatives if a.candidate.kind == "local")
    assert local.meets and local.candidate.late_arrivals > 0.25 and local.loss == local.candidate.late_arrivals
