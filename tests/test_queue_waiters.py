"""A remote prompt that joins a prefill queue already past its objective is charged for
the later prompts it pushes past theirs (`bystanders.queue_waiters_loss`); one that
meets its objective, or a queue nobody else joins, is not."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.config import SLO, WorkloadProfile
from router.auto_policy import best, score
from router.bystanders import queue_waiters_loss
from router.candidate import Candidate, Prediction
from router.policy import RouteContext
from router.replica_load import ReplicaLoad

SLO_LONG = SLO(ttft_ms=5200, tpot_ms=90)


@pytest.mark.parametrize(("rate", "done", "own", "objective", "lost"), [
    (1.0, 3.0, 1.0, 5.2, 0.0),  # done + own inside the objective: nobody after it misses
    (1.0, 4.7, 1.0, 5.2, 0.5),  # half its own span pushes later arrivals past
    (1.0, 9.0, 1.0, 5.2, 1.0),  # far past: every arrival during its own prefill
    (2.5, 9.0, 1.0, 5.2, 2.5),  # as many as arrive per second
    (0.0, 9.0, 1.0, 5.2, 0.0),  # a queue nobody else joins
])
def test_the_prompts_pushed_past_their_objective(rate, done, own, objective, lost):
    assert queue_waiters_loss(rate, done, own, objective) == pytest.approx(lost)


def _ctx(prompt_rate: float) -> RouteContext:
    prefill = ReplicaLoad("p1", "prefill", prompt_rate=prompt_rate)
    return RouteContext(prompt_len=1500, num_cached_tokens=0, profile=WorkloadProfile(mode="auto"),
                        num_healthy_prefill=1, decode=ReplicaLoad("d1", "decode"), prefills=(prefill,),
                        prefill_cached_tokens=(0,), max_tokens=16, slo=SLO_LONG, request_id="r")


def _remote(ttft_s: float) -> Candidate:
    return Candidate("remote", "d1", "p1", Prediction(ttft_s, 0.03), computed_tokens=1500,
                     prefill_done_s=ttft_s - 0.1, prefill_own_s=1.3)


def test_a_remote_prompt_past_its_objective_pays_for_the_queue_behind_it():
    late = _remote(5.5)
    alone, joined = (score(_ctx(rate), late, late.prediction) for rate in (0.0, 1.0))
    # done 5.4 + own 1.3 - objective 5.2 = 1.5, capped at its own 1.3 s: 1.3 prompts a second
    assert joined.loss - alone.loss == pytest.approx(1.3)
    on_time = _remote(4.0)  # inside its objective: the queue is not past anyone's yet
    assert score(_ctx(1.0), on_time, on_time.prediction).loss == score(_ctx(0.0), on_time, on_time.prediction).loss


def test_at_a_queue_past_saturation_a_prefill_beside_the_streams_wins():
    """Late remote (its own miss only) against a background prefill that meets its
    objective but costs the streams a little: the queue's growth decides."""
    late = _remote(5.5)
    beside = Candidate("background", "d1", "d1", Prediction(3.0, 0.05, 0.0), chunk_tokens=64,
                       computed_tokens=1500)
    for rate, winner in ((0.0, late), (1.0, beside)):
        ctx = _ctx(rate)
        scored = [score(ctx, late, late.prediction), score(ctx, beside, beside.prediction)]
        scored[1] = dataclasses.replace(scored[1], loss=1.2)  # what it costs the streams and joiners
        assert best(scored).candidate is winner, (rate, [s.loss for s in scored])
