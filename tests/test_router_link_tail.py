"""The KV transfer tail a prefill replica measured, back with the request's last chunk
(`GenerateChunk.transfer_tail_s`): the router takes it off the measured TTFT before it
corrects the step models, and a tail that stalled prices its link until the replica's
own report carries it (`LearnedState.link_tail_s`)."""

from __future__ import annotations

import math

import pytest

from cluster.config import SLO, RouterSettings
from router.auto_policy import AutoPolicy, candidates, corrected
from router.cluster_view import ClusterView
from router.corrections import LINK_REPORT_S, Corrections, Outcome
from router.learning import PolicyLearner, outcome_of
from router.metrics import RouterMetrics
from router.placement import Placement
from router.policy import RouteDecision
from router.streaming import Timing
from tests.test_auto_policy import BUSY_STREAMS, ctx, replica
from workers.engine_worker import HEARTBEAT_INTERVAL_S
from workers.protocol import GenerateChunk, PrefillResult
from workers.stream.wire import StreamRejected, chunk_from_wire, prefill_result_from_wire, to_wire


def _remote(predicted: float, tail: float, measured: float, measured_tail: float | None,
            prefill: str = "p1", decode: str = "d1") -> Outcome:
    return Outcome("disagg", prefill, decode, predicted, measured, predicted_transfer_s=tail,
                   worker_ttft_s=measured, measured_transfer_s=measured_tail)


def test_a_measured_tail_keeps_the_links_miss_out_of_the_step_models_factor():
    """The prompt computed in its predicted 90 ms and its KV then waited 0.81 s on the
    link: the model was right, so its factor stays 1. Told nothing of the tail, the
    router charged the model with the miss."""
    told, untold = Corrections(), Corrections()
    told.observe(_remote(0.1, 0.01, 0.9, 0.81), now=0.0)
    untold.observe(_remote(0.1, 0.01, 0.9, None), now=0.0)
    assert told.snapshot().factor("ttft", "disagg", "p1", 0.0) == pytest.approx(1.0)
    assert untold.snapshot().factor("ttft", "disagg", "p1", 0.0) > 2.0


def _remote_candidate(state, now: float, **kw):
    remote = [c for c in candidates(ctx(prompt_len=300, **kw)) if c.kind == "remote"]
    assert len(remote) == 1
    return remote[0], corrected(remote[0], state, now)


def test_a_stalled_transfer_prices_its_link_until_the_replicas_report_has_it():
    corrections = Corrections()
    corrections.observe(_remote(0.1, 0.01, 0.9, 0.81), now=10.0)
    state = corrections.snapshot()
    raw, shown = _remote_candidate(state, 10.5)
    assert shown.transfer_s == pytest.approx(0.81)
    assert shown.ttft_s - corrected(raw, Corrections().snapshot(), 10.5).ttft_s == pytest.approx(
        0.81 - raw.prediction.transfer_s)
    assert state.link_tail_s("p1", "d2", 10.5) == 0.0  # another pair's link is its own
    _, later = _remote_candidate(state, 10.0 + LINK_REPORT_S + 0.1)
    assert later.transfer_s == pytest.approx(raw.prediction.transfer_s)


def test_a_stall_is_priced_for_longer_than_the_replicas_report_takes_to_reach_the_router():
    """The replica's fit has the stall at its next heartbeat; a router reads it at its
    next poll, at the longest interval the settings allow."""
    longest_poll = next(m.le for m in RouterSettings.model_fields["state_poll_interval_s"].metadata
                        if getattr(m, "le", None) is not None)
    assert LINK_REPORT_S > HEARTBEAT_INTERVAL_S + longest_poll


def test_an_ordinary_transfer_ends_the_stall_and_noise_starts_none():
    corrections = Corrections()
    corrections.observe(_remote(0.1, 0.01, 0.9, 0.81), now=0.0)
    corrections.observe(_remote(0.1, 0.01, 0.1, 0.012), now=0.5)
    assert corrections.snapshot().link_tail_s("p1", "d1", 0.6) == 0.0
    corrections.observe(_remote(0.1, 0.01, 0.15, 0.06), now=1.0)  # 6x, 50 ms: within the fit's noise
    assert corrections.snapshot().link_tail_s("p1", "d1", 1.1) == 0.0
    corrections.observe(_remote(0.1, 0.01, 0.9, 0.81), now=2.0)
    corrections.reset()
    assert corrections.snapshot().links == {}


def test_auto_prefills_locally_right_after_its_last_transfer_stalled():
    """Streams on the decode replica make remote the choice; a transfer that just
    stalled 0.8 s against a 600 ms objective turns it local, before any report."""
    context = ctx(prompt_len=300, decode=replica("d1", **BUSY_STREAMS), slo=SLO(ttft_ms=600, tpot_ms=200))
    fresh = AutoPolicy(Corrections().snapshot(), 10.0).decide(context)
    assert fresh.route == "disagg"
    corrections = Corrections()
    corrections.observe(_remote(0.1, 0.01, 0.9, 0.81), now=10.0)
    assert AutoPolicy(corrections.snapshot(), 10.2).decide(context).route == "local"
    assert AutoPolicy(corrections.snapshot(), 10.0 + LINK_REPORT_S + 0.1).decide(context).route == "disagg"


def test_the_outcome_carries_the_tail_of_a_disaggregated_request_only():
    by_kind = {c.kind: c for c in candidates(ctx(prompt_len=300, decode=replica("d1", **BUSY_STREAMS)))}
    for kind, route, expected in (("remote", "disagg", 0.02), ("local", "local", None)):
        c = by_kind[kind]
        placement = Placement("decode", c.decode_replica, None,
                              RouteDecision(route, "slo-local", candidate=c, prediction=c.prediction), 0)
        assert outcome_of(placement, 0.3, None, 0.25, transfer_tail_s=0.02).measured_transfer_s == expected


def test_timing_hands_the_last_chunks_tail_to_the_learner():
    got = []
    timing = Timing(RouterMetrics("tiny"), "disagg", "default", 0.0, lambda *a: got.append(a))
    timing.chunk(GenerateChunk(token_ids=[1]))
    timing.chunk(GenerateChunk(token_ids=[2], finished=True, transfer_tail_s=0.004))
    timing.finish()
    assert len(got) == 1 and got[0][2] == 0.004


@pytest.mark.parametrize("value", [-0.1, "1", math.inf, math.nan, [1.0]])
def test_a_malformed_tail_is_rejected_on_the_wire(value):
    raw = to_wire(GenerateChunk(token_ids=[1], finished=True))
    raw["transfer_tail_s"] = value
    with pytest.raises(StreamRejected):
        chunk_from_wire(raw)
    reply = to_wire(PrefillResult(0, 1024, 0.05))
    reply["tail_s"] = value
    with pytest.raises(StreamRejected):
        prefill_result_from_wire(reply)


def test_a_tail_crosses_the_wire_and_an_older_replica_says_none():
    assert chunk_from_wire(to_wire(GenerateChunk(finished=True, transfer_tail_s=0.003))).transfer_tail_s == 0.003
    assert prefill_result_from_wire(to_wire(PrefillResult(0, 1024, 0.05, tail_s=0.002))).tail_s == 0.002
    older = to_wire(PrefillResult(0, 1024, 0.05))
    del older["tail_s"]
    assert prefill_result_from_wire(older).tail_s is None


def test_admin_policy_lists_the_links_priced_from_a_stall():
    clock = [100.0]
    learner = PolicyLearner(RouterSettings(), RouterMetrics("m"), "router:test", clock=lambda: clock[0])
    learner.corrections.observe(_remote(0.1, 0.01, 0.9, 0.81), now=100.0)
    stalled = learner.describe(ClusterView(16, 64))["stalled_links"]
    assert list(stalled) == ["p1->d1"] and stalled["p1->d1"]["tail_s"] == 0.81
    clock[0] += LINK_REPORT_S + 0.1
    assert learner.describe(ClusterView(16, 64))["stalled_links"] == {}
