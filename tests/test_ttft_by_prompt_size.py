"""A long prompt's TTFT is corrected apart from short prompts' on the same route and
replica: a short prompt's error is mostly the steps and hops around its prefill, and
rescaled by it a long prompt's prefill looks slower (or faster) than it is."""

from __future__ import annotations

import pytest

from router.auto_policy import candidates, corrected
from router.candidate import LONG_PROMPT_TOKENS, Candidate
from router.corrections import Corrections, Outcome
from router.learning import outcome_of
from router.placement import Placement
from router.policy import RouteDecision
from tests.test_auto_policy import ctx


def by_kind(prompt_len: int, num_cached_tokens: int = 0) -> dict[str, Candidate]:
    return {c.kind: c for c in candidates(ctx(prompt_len=prompt_len, num_cached_tokens=num_cached_tokens,
                                              prefill_cached_tokens=(num_cached_tokens,)))}


def test_a_candidate_learns_its_ttft_by_the_tokens_it_computes():
    long, short = by_kind(1500), by_kind(100)
    assert long["remote"].computed_tokens == 1500 and long["remote"].ttft_learned_as == "disagg:long"
    assert long["local"].ttft_learned_as == "local:long" and short["local"].ttft_learned_as == "local"
    assert long["remote"].learned_as == "disagg"  # its TPOT is learned with every other prompt's
    cached = by_kind(1500, num_cached_tokens=1200)  # 300 computed: a short prefill behind a cached prefix
    assert cached["remote"].computed_tokens == 300 and cached["remote"].ttft_learned_as == "disagg"
    edge = by_kind(LONG_PROMPT_TOKENS)
    assert edge["local"].ttft_learned_as == "local:long"


def test_a_short_prompts_slow_ttft_leaves_a_long_ones_prediction_alone():
    corrections = Corrections()
    corrections.observe(Outcome("disagg", "p1", "d1", 0.132, 0.264, learned_as="disagg",
                                ttft_learned_as="disagg"), now=0.0)
    state = corrections.snapshot()
    long, short = by_kind(1500)["remote"], by_kind(100)["remote"]
    assert corrected(long, state, 0.0).ttft_s == pytest.approx(long.prediction.ttft_s)
    assert corrected(short, state, 0.0).ttft_s > short.prediction.ttft_s * 1.3
    corrections.observe(Outcome("disagg", "p1", "d1", 1.7, 1.5, ttft_learned_as="disagg:long"), now=1.0)
    state = corrections.snapshot()
    assert state.factor("ttft", "disagg:long", "p1", 1.0) < 1.0 < state.factor("ttft", "disagg", "p1", 1.0)


def test_the_outcome_of_a_placement_keeps_its_candidates_ttft_key():
    long = by_kind(1500)["remote"]
    placement = Placement("decode", "d1", "p1", RouteDecision("disagg", "slo-disagg", candidate=long,
                                                              prediction=long.prediction), 0)
    outcome = outcome_of(placement, ttft_s=2.0, tpot_s=0.03)
    assert outcome.ttft_key == "disagg:long" and outcome.key == "disagg"
    corrections = Corrections()
    corrections.observe(outcome, now=0.0)
    assert set(corrections.by_replica(0.0)["p1"]) == {"ttft/disagg:long"}
    assert set(corrections.by_replica(0.0)["d1"]) == {"tpot/disagg", "tpot/streams"}
