"""The streams that join a decode replica while a candidate's prompt chunks slow it:
the arrival rate the router's view keeps, and the decision it changes."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.config import SLO
from router import replica_steps
from router.arrival_rate import ArrivalRate
from router.candidate import RequestShape
from tests.test_auto_policy import ctx, replica
from workers.engine.cost_model import StepCoefficients

CPU = StepCoefficients(0.01, 4e-4, 1.4e-7, 1e-3, 3.5e-6)  # the bench's CPU replicas, fitted


def test_the_rate_counts_the_placements_of_the_window_per_replica():
    rate = ArrivalRate(window_s=10.0)
    for i in range(40):
        rate.add("d1", 0.25 * i)  # 4/s for 10 s
    rate.add("d2", 5.0)
    assert rate.rate("d1", 10.0) == pytest.approx(4.0)
    assert rate.rate("d1", 15.0) == pytest.approx(2.0)  # the first 5 s have left the window
    assert rate.rate("d2", 15.0) == pytest.approx(0.1) and rate.rate("d3", 15.0) == 0.0
    rate.forget({"d2"})
    assert rate.rate("d1", 15.0) == 0.0


def test_the_view_reports_the_rate_of_requests_placed_to_decode_on_a_replica():
    from router.cluster_view import ClusterView, ReplicaInfo
    from router.placement import Placement
    from router.policy import RouteDecision

    view = ClusterView(16, 8)
    d1 = ReplicaInfo("d1", "decode")
    view.update([d1, ReplicaInfo("p1", "prefill")])
    for i in range(20):
        view.begin(Placement("decode", "d1", "p1" if i % 2 else None, RouteDecision("local", "slo-local"), 0,
                             prefill_on="p1" if i % 2 else "d1", prefill_tokens=50, placed_at=float(i)))
    assert view.load_of(d1, now=20.0).arrival_rate == pytest.approx(1.0)  # 10 of them in the last 10 s
    assert view.load_of(view.replicas["p1"], now=20.0).arrival_rate == 0.0  # prefilled there, decoded elsewhere


def test_a_long_background_prefill_loses_to_remote_where_requests_keep_arriving():
    """A decision from `bench cluster`'s balanced cell (two repeats of three): a 1,496-token
    prompt beside six streams, every route meeting its objectives. The background prefill
    left the six streams 37% of their budget, remote 25%, so by the margins it went to the
    background, ran 4.5 s, and the short requests arriving at 4/s meanwhile decoded beside
    its chunks at 70-90 ms a token against 63. Counting the ~18 that join while it runs, it
    goes remote; with none arriving, the background prefill still wins."""
    from router.auto_policy import best, score
    from router.candidate import Candidate, Prediction

    context = ctx(prompt_len=1496, slo=SLO(ttft_ms=5916, tpot_ms=63), decode=replica("d1", num_streams=6))
    background = Candidate("background", "d1", "d1", Prediction(4.226, 0.0296, 0.0396), 21, 6)
    remote = Candidate("remote", "d1", "p1", Prediction(2.116, 0.046, 0.047), None, 6)

    def pick(joining: float) -> str:
        routes = [dataclasses.replace(background, joining_streams=joining), remote]
        scored = [score(context, c, c.prediction) for c in routes]
        assert all(s.meets and s.loss == 0.0 for s in scored)
        return best(scored).candidate.kind

    assert pick(0.0) == "background"
    assert pick(4.0 * 4.2) == "remote"


def test_a_candidate_knows_the_streams_joining_while_its_chunks_run():
    from router import predict

    req = RequestShape(1496, 16)
    quiet = replica("d1", num_streams=6, stream_context=6 * 150, stream_tokens_left=20.0)
    busy = dataclasses.replace(quiet, arrival_rate=4.0)
    for d in (quiet, busy):
        slow = predict.background(req, d, 0, 0.012)
        assert slow is not None
        assert slow.joining_streams == pytest.approx(d.arrival_rate * predict.drain(
            d, predict.own_prompt(0, 1496, slow.chunk_tokens, background_chunk=slow.chunk_tokens)).own_s)
    assert predict.background(req, busy, 0, 0.012).joining_streams > 1.0
    assert predict.remote(req, replica("p1", "prefill"), busy, 0, 0).joining_streams == 0.0


def test_streams_past_reach_do_not_make_a_foreground_prefill_free_for_the_requests_arriving():
    """Every stream on the decode replica is past its budget, but its gaps (56 ms lately)
    are inside the 68 ms objective the arriving requests bring. A 1,500-token prompt
    prefilled there in the foreground would stall every request that starts decoding
    meanwhile: what it adds to their chance of missing is lost, and it goes to the idle
    prefill replica instead. Where nothing arrives, nobody else pays for it locally."""
    from router.auto_policy import AutoPolicy, candidates, score

    slo = SLO(ttft_ms=3300, tpot_ms=68)

    def scored(arrival_rate: float) -> dict:
        decode = replica("d1", coefficients=CPU, num_streams=4, stream_context=4 * 1500, stream_tokens_left=8.0,
                         stream_allowances=(0.0,) * 4, recent_gap_s=0.056, arrival_rate=arrival_rate)
        context = ctx(prompt_len=1500, slo=slo, decode=decode, max_tokens=16,
                      prefills=(replica("p1", "prefill", coefficients=CPU),))
        return context, {c.kind: score(context, c, c.prediction) for c in candidates(context)}

    context, busy = scored(1.3)
    local = busy["local"]
    assert local.candidate.joining_streams > 0.5
    assert local.loss >= 0.5 * local.candidate.joining_streams  # they land far past 68 ms beside its chunks
    assert AutoPolicy().decide(context).candidate.kind == "remote"
    _, quiet = scored(0.0)
    assert quiet["local"].loss < 0.5 and quiet["local"].loss < local.loss


def test_a_prefill_on_an_empty_decode_replica_prices_the_requests_that_join_meanwhile():
    """Nothing decodes on the decode replica yet, but long prompts prefilling remotely keep
    landing there (1.3 a second). A 1,470-token prompt prefilled there in the foreground
    stalls whichever of them starts decoding during its 0.8 s: the candidate prices such
    a request's TPOT (half its chunks, on average: 42 ms against 36), and with arrivals
    the prompt goes to the idle prefill replica; with none, local is free and its shorter
    TTFT wins."""
    from router import predict
    from router.auto_policy import AutoPolicy, candidates, score

    slo = SLO(ttft_ms=4200, tpot_ms=36)

    def context(arrival_rate: float):
        decode = replica("d1", coefficients=CPU, arrival_rate=arrival_rate)
        return ctx(prompt_len=1470, slo=slo, decode=decode, max_tokens=16,
                   prefills=(replica("p1", "prefill", coefficients=CPU),))

    busy = context(1.3)
    local = predict.local(RequestShape(1470, 16), busy.decode, 0)
    prefill = predict.drain(busy.decode, predict.foreground(busy.decode, 0, 1470))
    assert local.num_streams == 0 and local.joining_streams == pytest.approx(1.3 * prefill.own_s)
    assert local.joining_streams > 1.0
    assert local.prediction.streams_tpot_s > slo.tpot_ms / 1000 > local.prediction.tpot_s
    scored = {c.kind: score(busy, c, c.prediction) for c in candidates(busy)}
    assert scored["local"].loss > scored["remote"].loss
    assert AutoPolicy().decide(busy).candidate.kind == "remote"
    quiet = context(0.0)
    assert predict.local(RequestShape(1470, 16), quiet.decode, 0).prediction.streams_tpot_s == 0.0
    assert AutoPolicy().decide(quiet).candidate.kind == "local"


def test_requests_prefilling_elsewhere_and_due_during_a_local_prefill_join_it():
    """Nothing decodes on the decode replica and nothing was placed there lately, but two
    long prompts prefilling remotely are due there 0.3 and 0.6 s from now, too far to count
    as streams yet (their own decode is shorter). A 1,470-token prompt prefilled there in
    the foreground for about 0.8 s stalls both: they join it, and the prompt goes to the
    prefill replica; due after its chunks end, they cost it nothing."""
    from router import predict
    from router.auto_policy import AutoPolicy


    def context(due: tuple[float, ...]):
        decode = replica("d1", coefficients=CPU, incoming_due_s=due)
        return ctx(prompt_len=1470, slo=SLO(ttft_ms=4200, tpot_ms=36), decode=decode, max_tokens=16,
                   prefills=(replica("p1", "prefill", coefficients=CPU),))

    soon, later = context((0.3, 0.6)), context((3.0, 4.0))
    own_s = predict.drain(soon.decode, predict.foreground(soon.decode, 0, 1470)).own_s
    assert 0.6 < own_s < 3.0
    assert predict.local(RequestShape(1470, 16), soon.decode, 0).joining_streams == 2
    assert predict.local(RequestShape(1470, 16), later.decode, 0).joining_streams == 0
    assert AutoPolicy().decide(soon).candidate.kind == "remote"
    assert AutoPolicy().decide(later).candidate.kind == "local"


def test_an_idle_decode_replica_with_remote_prefills_due_offers_a_background_prefill():
    """A decision from `bench cluster`'s load shift: a 1,317-token prompt, nothing decoding
    on the decode replica yet but two remote prefills due to land there within 2.6 s,
    the prefill replica 4,037 tokens behind. In the foreground the prompt would stall them
    as they start decoding (56 ms a token against 53), remote it waits 3 s of a 3.4 s
    objective; in the background its chunks cost about one decode step of theirs, so it
    goes there. With nothing due, the background candidate is not offered: the engine
    would give it the whole budget, as `local`."""
    from router import predict
    from router.auto_policy import AutoPolicy, candidates, score

    decode_model = StepCoefficients(0.0099, 3.6e-4, 2.2e-7, 6e-5, 2.3e-6, node_contention=0.45).slowed(1.0)
    prefill_model = StepCoefficients(0.0086, 4.2e-4, 9.3e-8, 1.3e-3, 2.7e-6, node_contention=0.2).slowed(1.0)
    slo = SLO(ttft_ms=3433, tpot_ms=53)

    def context(due: tuple[float, ...]):
        d = replica("d1", coefficients=decode_model, incoming_due_s=due, arrival_rate=1.7, recent_gap_s=0.0186,
                    stream_allowances=(0.053,) * len(due))
        p = replica("p1", "prefill", coefficients=prefill_model, queue_tokens=4037, num_requests=2)
        return ctx(prompt_len=1317, slo=slo, decode=d, max_tokens=16, prefills=(p,))

    due = context((1.57, 2.61))
    scored = {c.kind: score(due, c, c.prediction) for c in candidates(due)}
    background, local = scored["background"].candidate, scored["local"].candidate
    one_step = replica_steps.decode_step_s(due.decode, 1.0, 1317)
    chunk_cost = background.chunk_tokens * (decode_model.prefill_token_s + decode_model.prefill_attention_s * 1317)
    assert chunk_cost <= one_step * predict.IDLE_CHUNK_DECODE_STEPS
    assert background.prediction.streams_tpot_s < 0.053 < local.prediction.streams_tpot_s
    assert scored["background"].loss < scored["local"].loss
    assert AutoPolicy().decide(due).candidate.kind == "background"
    quiet = context(())
    assert "background" not in {c.kind for c in candidates(quiet)}
    assert AutoPolicy().decide(quiet).candidate.kind == "remote"


def test_a_prompt_that_fits_one_chunk_is_not_offered_the_background_on_an_idle_replica():
    from router import predict

    d = replica("d1", coefficients=CPU, incoming_due_s=(0.5,))
    assert predict.background(RequestShape(20, 8), d, 0, 0.05) is None
    assert predict.background(RequestShape(1500, 8), d, 0, 0.05) is not None
