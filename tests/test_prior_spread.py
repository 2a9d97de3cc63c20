"""Before a route has its own residuals, a router weighs its predictions by a prior
spread: a prediction near its objective is a coin flip, not a sure thing, so slack
counts from the first request."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cluster.config import SLO
from router.auto_policy import score
from router.corrections import (
    BACKGROUND,
    EMPTY,
    MIN_RESIDUALS,
    PRIOR_SPREAD,
    STREAMS,
    Corrections,
    Outcome,
)
from router.routing import decide
from tests.test_auto_policy import ctx, replica


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


@pytest.mark.parametrize(("predicted_s", "objective_s"), [(0.1, 0.1), (0.1, 0.12), (0.1, 0.2), (0.2, 0.1)])
def test_a_cold_router_reads_the_chance_off_a_log_normal_spread(predicted_s, objective_s):
    state = Corrections().snapshot()
    chance = state.chance_within("tpot", "local", predicted_s, objective_s, now=0.0)
    assert chance == pytest.approx(_normal_cdf(math.log(objective_s / predicted_s) / PRIOR_SPREAD))
    assert EMPTY.chance_within("tpot", "local", predicted_s, objective_s, now=0.0) is None  # a bare state: exact


def test_a_prediction_at_its_objective_is_a_coin_flip_and_more_slack_is_a_better_bet():
    state = Corrections().snapshot()
    at, inside, far = (state.chance_within("ttft", "disagg", p, 0.4, 0.0) for p in (0.4, 0.34, 0.2))
    assert at == pytest.approx(0.5) and at < inside < far < 1.0
    assert inside < 0.75  # 15% of slack still misses one time in four


def test_the_routes_own_residuals_replace_the_prior_once_there_are_enough():
    c = Corrections()
    for _ in range(MIN_RESIDUALS):
        c.observe(Outcome("local", "d1", "d1", 0.1, 0.1), now=0.0)  # always on the dot
    state = c.snapshot()
    assert state.chance_within("ttft", "local", 0.1, 0.101, 0.0) == 1.0
    assert state.chance_within("ttft", "disagg", 0.1, 0.101, 0.0) == pytest.approx(_normal_cdf(
        math.log(1.01) / PRIOR_SPREAD))  # the other route: still the prior


def test_streams_kept_just_inside_their_objective_cost_a_cold_router_something():
    """Eight streams predicted 5% inside their objective beside a local prefill: taken
    as exact they lose nothing; under the prior each is nearly a coin flip, which costs
    more than a whole request over the eight (beyond the misses they would have with
    nothing added beside them)."""
    busy = {"num_streams": 8, "stream_context": 8 * 600, "stream_tokens_left": 40.0}
    context = ctx(prompt_len=300, decode=replica("d1", **busy), slo=SLO(ttft_ms=2000, tpot_ms=50))
    local = next(a for a in decide(context, EMPTY).alternatives if a.candidate.kind == "local")
    objective = local.prediction.streams_tpot_s / 0.95
    tight = ctx(prompt_len=300, decode=replica("d1", **busy), slo=SLO(ttft_ms=2000, tpot_ms=objective * 1e3))
    candidate = local.candidate
    exact = score(tight, candidate, candidate.prediction, EMPTY)
    cold = score(tight, candidate, candidate.prediction, Corrections().snapshot())
    assert exact.meets and exact.loss == pytest.approx(0.0)
    assert cold.loss > 1.0


def test_tpot_spread_is_learned_per_decode_stream_not_per_route():
    """A request decodes as one more stream on its decode replica whichever way its prompt
    ran, so the TPOT outcomes of every foreground route make one spread, which weighs
    every route's own TPOT and the streams beside it alike; background prefills keep
    theirs. Kept per route, the remote requests whose decode the later local prefills
    stalled made the remote route's own TPOT look the worse bet, and the next long
    prompt prefilled locally, stalling the next ones."""
    c = Corrections()
    for i in range(MIN_RESIDUALS):  # remote requests that decoded at 1-3x their prediction
        c.observe(Outcome("disagg", "p1", "d1", 1.0, 1.0, 0.02, 0.02 * (1 + i % 3)), now=0.0)
    state = c.snapshot()
    assert ("tpot", "disagg") not in state.residuals and len(state.residuals["tpot", STREAMS]) == MIN_RESIDUALS
    assert state.chance_within("tpot", STREAMS, 0.02, 0.03, 0.0) < 0.8  # learned (the prior says 0.91)
    assert state.chance_within("tpot", BACKGROUND, 0.02, 0.03, 0.0) == pytest.approx(_normal_cdf(
        math.log(1.5) / PRIOR_SPREAD))  # nothing learned of background prefills
    context = ctx(prompt_len=1000, slo=SLO(ttft_ms=5000, tpot_ms=30))
    by_kind = {a.candidate.kind: a.candidate for a in decide(context, EMPTY).alternatives}
    local, remote = (score(context, by_kind[k], by_kind[k].prediction, state) for k in ("local", "remote"))
    same = dataclasses.replace(by_kind["local"].prediction, tpot_s=remote.prediction.tpot_s)
    assert score(context, by_kind["local"], same, state).loss == pytest.approx(remote.loss)
    assert local.meets and remote.meets
