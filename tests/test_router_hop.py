"""The hop between the router and the replica it calls: the router's TTFT beyond the
worker's own (`GenerateChunk.worker_ttft_s`). It is measured per replica, added to every
TTFT prediction after the step models' correction factor, and kept out of that factor,
which would otherwise scale a fixed cost with the prediction."""

from __future__ import annotations

import math

import pytest

from router.auto_policy import candidates, corrected
from router.candidate import Prediction
from router.corrections import ANY_REPLICA, HOP_SMOOTHING, MAX_HOP_S, Corrections, Outcome
from router.learning import outcome_of
from router.placement import Placement
from router.policy import RouteDecision
from tests.test_auto_policy import ctx
from workers.protocol import GenerateChunk
from workers.stream.wire import StreamRejected, chunk_from_wire, to_wire


def _local(predicted: float, measured: float, worker: float | None, decode: str = "d1") -> Outcome:
    return Outcome("local", decode, decode, predicted, measured, worker_ttft_s=worker)


def test_the_hop_is_the_routers_ttft_beyond_the_workers_own():
    assert _local(0.1, 0.13, 0.1).hop_s == pytest.approx(0.03)
    assert _local(0.1, 0.13, None).hop_s is None  # an older worker says nothing
    assert _local(0.1, 0.09, 0.1).hop_s == 0.0  # chunks bunched on the way: never negative
    assert _local(0.1, 60.0, 0.1).hop_s == MAX_HOP_S
    assert _local(0.1, 0.13, math.nan).hop_s is None


def test_a_fixed_hop_is_learned_apart_and_leaves_the_factor_alone():
    """Every request ran exactly as its step model said and came back 30 ms later: the
    factor stays 1 and the hop carries the 30 ms, whatever the prediction's size."""
    corrections = Corrections()
    for i, model in enumerate((0.05, 0.2, 0.08, 1.0)):
        corrections.observe(_local(model, model + 0.03, model), now=float(i))
    state = corrections.snapshot()
    assert state.factor("ttft", "local", "d1", 4.0) == pytest.approx(1.0)
    assert state.hop_s("d1") == pytest.approx(0.03)
    assert state.hop_s("elsewhere") == pytest.approx(0.03)  # unmeasured: every replica's


def test_the_hop_is_smoothed_per_replica_and_pooled_over_all():
    corrections = Corrections()
    corrections.observe(_local(0.1, 0.11, 0.1, decode="d1"), now=0.0)
    corrections.observe(_local(0.1, 0.15, 0.1, decode="d2"), now=1.0)
    corrections.observe(_local(0.1, 0.20, 0.1, decode="d1"), now=2.0)
    hops = corrections.hops()
    assert hops["d1"] == pytest.approx(0.01 + HOP_SMOOTHING * (0.10 - 0.01))
    assert hops["d2"] == pytest.approx(0.05)
    pooled = 0.01 + HOP_SMOOTHING * (0.05 - 0.01)
    assert hops[ANY_REPLICA] == pytest.approx(pooled + HOP_SMOOTHING * (0.10 - pooled))


def test_corrected_predictions_carry_the_hop_to_the_replica_called():
    """A remote candidate's TTFT gains the hop to its decode replica (the router calls
    that one); the TPOT predictions are untouched."""
    corrections = Corrections()
    corrections.observe(Outcome("disagg", "p1", "d1", 0.2, 0.245, worker_ttft_s=0.2), now=0.0)
    state = corrections.snapshot()
    for candidate in candidates(ctx(prompt_len=100)):
        shown = corrected(candidate, state, 0.0)
        hop = 0.045 if candidate.decode_replica == "d1" else state.hop_s(candidate.decode_replica)
        assert shown.ttft_s == pytest.approx(candidate.prediction.ttft_s + hop)
        assert shown.tpot_s == pytest.approx(candidate.prediction.tpot_s)


def test_the_residual_is_against_the_prediction_with_its_hop():
    """Once the hop is known, a request that took its model's time plus that hop lands
    exactly on its corrected prediction."""
    corrections = Corrections()
    corrections.observe(_local(0.1, 0.13, 0.1), now=0.0)
    corrections.observe(_local(0.1, 0.13, 0.1), now=1.0)
    ratios = corrections.snapshot().residuals[("ttft", "local")]  # ascending
    assert ratios == pytest.approx((1.0, 0.13 / 0.1))


def test_a_reset_forgets_the_factors_but_not_the_hops():
    corrections = Corrections()
    corrections.observe(_local(0.1, 0.2, 0.15), now=0.0)
    corrections.reset()
    state = corrections.snapshot()
    assert state.factor("ttft", "local", "d1", 0.0) == 1.0 and state.hop_s("d1") == pytest.approx(0.05)


def test_the_outcome_of_a_placement_carries_the_workers_ttft():
    candidate = {c.kind: c for c in candidates(ctx(prompt_len=100))}["local"]
    placement = Placement("decode", candidate.decode_replica, None,
                          RouteDecision("local", "slo-local", candidate=candidate, prediction=candidate.prediction), 0)
    assert outcome_of(placement, 0.3, None, worker_ttft_s=0.25).hop_s == pytest.approx(0.05)
    assert outcome_of(placement, 0.3, None).hop_s is None


@pytest.mark.parametrize("value", [-0.1, "1", math.inf, math.nan, [1.0]])
def test_a_malformed_worker_ttft_is_rejected_on_the_wire(value):
    raw = to_wire(GenerateChunk(token_ids=[1]))
    raw["worker_ttft_s"] = value
    with pytest.raises(StreamRejected):
        chunk_from_wire(raw)


def test_a_worker_ttft_crosses_the_wire():
    chunk = GenerateChunk(token_ids=[1], worker_ttft_s=0.0125)
    assert chunk_from_wire(to_wire(chunk)).worker_ttft_s == 0.0125
    assert chunk_from_wire(to_wire(GenerateChunk(token_ids=[1]))).worker_ttft_s is None


def test_the_hop_is_not_scaled_by_the_overdue_factor():
    prediction = Prediction(ttft_s=0.2, tpot_s=0.02, transfer_s=0.05)
    shown = prediction.scaled(2.0, 1.0, overdue=1.5, hop_s=0.03)
    assert shown.ttft_s == pytest.approx(((0.2 - 0.05) * 2.0 + 0.05) * 1.5 + 0.03)
