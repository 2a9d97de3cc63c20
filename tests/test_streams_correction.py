"""The streams beside a candidate are corrected by one factor per decode replica,
learned from every TPOT outcome there, whichever way the new prompt runs."""

from __future__ import annotations

import pytest

from router.auto_policy import candidates, corrected
from router.corrections import Corrections, Outcome
from tests.test_auto_policy import BUSY_STREAMS, ctx, replica


def test_the_streams_beside_every_candidate_are_rescaled_alike():
    """The same streams, whichever way the new prompt runs: their TPOT takes the factor
    learned from every TPOT outcome on the decode replica, not the candidate's own, so a
    background prefill whose last outcomes came in fast does not make them look faster
    beside it than beside a foreground prefill; where its own factor is the larger, it
    holds (its chunks slow the replica for seconds)."""
    corrections = Corrections()
    corrections.observe(Outcome("local", "d1", "d1", 0.3, 0.3, 0.030, 0.060), now=0.0)
    corrections.observe(Outcome("local", "d1", "d1", 0.3, 0.3, 0.030, 0.015, learned_as="background"), now=0.0)
    state = corrections.snapshot()
    local_f, background_f, streams_f = (state.factor("tpot", key, "d1", 0.0) for key in ("local", "background", "streams"))
    assert background_f < streams_f < 1.0 < local_f
    # 400 tokens: more than one background chunk, fewer than a long prompt's
    by_kind = {c.kind: c for c in candidates(ctx(prompt_len=400, decode=replica("d1", **BUSY_STREAMS)))}
    assert by_kind["background"].yields
    for kind in ("local", "background", "remote"):
        c = by_kind[kind]
        shown = corrected(c, state, 0.0)
        assert shown.streams_tpot_s == pytest.approx(c.prediction.streams_tpot_s * streams_f), kind
    assert corrected(by_kind["background"], state, 0.0).tpot_s == pytest.approx(
        by_kind["background"].prediction.tpot_s * background_f)
    later = Corrections()  # a background prefill came in slow, a foreground one fast since
    later.observe(Outcome("local", "d1", "d1", 1.0, 1.0, 0.02, 0.08, learned_as="background"), now=1.0)
    later.observe(Outcome("local", "d1", "d1", 0.3, 0.3, 0.02, 0.01), now=1.0)
    slow = later.snapshot()
    assert slow.factor("tpot", "background", "d1", 1.0) > slow.factor("tpot", "streams", "d1", 1.0)
    assert corrected(by_kind["background"], slow, 1.0).streams_tpot_s == pytest.approx(
        by_kind["background"].prediction.streams_tpot_s * slow.factor("tpot", "background", "d1", 1.0))


def test_a_requests_own_tpot_is_corrected_as_every_stream_on_its_decode_replica():
    """It decodes there as one more stream whichever way its prompt was computed: a
    remote prefill's and a local one's own TPOT take the replica's streams factor, so
    outcomes of one route alone (those that came in while the replica was stalled) do not
    make that route look slower to decode on the same replica. A background prefill
    keeps its own."""
    corrections = Corrections()
    for _ in range(3):
        corrections.observe(Outcome("disagg", "p1", "d1", 1.0, 1.0, 0.030, 0.090), now=0.0)
    state = corrections.snapshot()
    streams_f = state.factor("tpot", "streams", "d1", 0.0)
    assert streams_f > 2.0 and state.factor("tpot", "local", "d1", 0.0) == 1.0
    prefill = replica("p1", role="prefill")
    by_kind = {c.kind: c for c in candidates(ctx(prompt_len=400, decode=replica("d1", **BUSY_STREAMS),
                                                prefills=[prefill]))}
    for kind in ("local", "remote"):
        c = by_kind[kind]
        assert corrected(c, state, 0.0).tpot_s == pytest.approx(c.prediction.tpot_s * streams_f), kind
    background = by_kind["background"]
    assert corrected(background, state, 0.0).tpot_s == pytest.approx(background.prediction.tpot_s)


def test_a_background_prompt_that_fits_in_one_chunk_is_corrected_as_a_foreground_one():
    """It runs in one step, as a foreground prompt does: the background factors, learned
    from prefills that yield for seconds, do not make it look quicker than local on the
    same replica. A prompt of many chunks keeps them."""
    corrections = Corrections()
    corrections.observe(Outcome("local", "d1", "d1", 0.3, 0.15, 0.030, 0.015, learned_as="background"), now=0.0)
    corrections.observe(Outcome("local", "d1", "d1", 0.3, 0.45, 0.030, 0.030), now=0.0)
    state = corrections.snapshot()
    local_f, background_f = (state.factor("ttft", key, "d1", 0.0) for key in ("local", "background"))
    assert background_f < 1.0 < local_f
    decode = replica("d1", **BUSY_STREAMS)
    short = {c.kind: c for c in candidates(ctx(prompt_len=60, decode=decode))}
    assert short["background"].chunk_tokens >= 60 and not short["background"].yields
    assert short["background"].learned_as == "local"
    assert corrected(short["background"], state, 0.0).ttft_s == pytest.approx(
        short["background"].prediction.ttft_s * local_f)
    chunks = {c.kind: c for c in candidates(ctx(prompt_len=400, decode=decode))}
    assert chunks["background"].yields and chunks["background"].learned_as == "background"
    assert corrected(chunks["background"], state, 0.0).ttft_s == pytest.approx(
        chunks["background"].prediction.ttft_s * background_f)


def test_a_tpot_over_few_gaps_moves_the_factor_in_proportion():
    """A two-token request (one gap: the load tester's probe on an idle replica) moves the
    streams' factor an eighth as far as a request of 32 tokens; a request of 8 tokens or
    more, or of an unknown length, moves it the whole `SMOOTHING` of the way."""
    import math

    from router.corrections import SMOOTHING, tpot_weight

    def factor_after(gaps: int) -> float:
        corrections = Corrections()
        corrections.observe(Outcome("local", "d1", "d1", 0.1, 0.1, 0.036, 0.013, tpot_gaps=gaps), now=0.0)
        return corrections.snapshot().factor("tpot", "streams", "d1", 0.0)

    full = math.exp(SMOOTHING * math.log(0.013 / 0.036))  # 0.60
    assert factor_after(31) == pytest.approx(full) == pytest.approx(factor_after(0))
    assert factor_after(1) == pytest.approx(math.exp(SMOOTHING / 8 * math.log(0.013 / 0.036)))  # 0.94
    assert factor_after(1) > 0.9 > factor_after(4) > factor_after(8) == pytest.approx(full)
    assert [tpot_weight(g) for g in (0, 1, 4, 8, 100)] == [SMOOTHING, SMOOTHING / 8, SMOOTHING / 2, SMOOTHING, SMOOTHING]


def test_the_router_learns_a_tpot_over_the_tokens_it_streamed_back():
    from router.candidate import Candidate, Prediction
    from router.learning import outcome_of
    from router.placement import Placement
    from router.policy import RouteDecision

    candidate = Candidate("local", "d1", "d1", Prediction(0.1, 0.03, 0.0))
    placement = Placement("decode", "d1", None, RouteDecision("local", "slo-local", candidate=candidate,
                                                               prediction=candidate.prediction), 0)
    placement.max_tokens = 32
    assert outcome_of(placement, 0.1, 0.02).tpot_gaps == 31  # nothing tracked: as many as it asked for
    placement.tokens_back = 2  # it stopped after two
    assert outcome_of(placement, 0.1, 0.02).tpot_gaps == 1
