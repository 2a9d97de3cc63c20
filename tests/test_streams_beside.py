"""The streams already decoding beside a prefill: a prompt queued ahead that will be one,
streams held to the budget they have left, the margin counted once per stream, and
streams past reach — one that would miss its TPOT objective even with nothing added
beside it neither sets the other streams' objective nor counts as lost to any route.

In `bench cluster`'s tight cells seven decisions in ten with two or more streams on the
decode replica had a stream whose allowance was below the replica's recent gap; it set
every stream's objective, so every route looked as if it broke all of them, and a
background prefill was sized at one token a step.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from cluster.config import SLO, WorkloadProfile
from router import predict, replica_steps
from router.auto_policy import candidates, score
from router.bystanders import stream_objective_s
from router.candidate import RequestShape
from router.cluster_view import ClusterView, ReplicaInfo
from router.placement import PolicyInputs, place
from router.routing import decide
from tests.test_auto_policy import BUSY_STREAMS, ctx, replica
from workers.engine.cost_model import StepCoefficients

TIGHT = SLO(ttft_ms=2000, tpot_ms=12)
SATURATED = (replica("p1", "prefill", queue_tokens=40_000),)


def test_the_view_lists_each_streams_allowance_with_those_past_reach_at_zero():
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([ReplicaInfo("d1", "decode")])
    local = WorkloadProfile(mode="local")
    placed = []
    for tpot_ms in (50, 20):
        inputs = PolicyInputs(slo=SLO(ttft_ms=1000, tpot_ms=tpot_ms), now=10.0)
        p = place(view, [1] * 40, 17, local, None, offload_to_prefill=False, inputs=inputs)
        view.begin(p)
        placed.append(p)
    d = view.replicas["d1"]
    assert view.load_of(d, now=10.0).stream_allowances == pytest.approx((0.020, 0.050))
    for p in placed:
        view.prefill_done(p, now=11.0, num_tokens=1)
        view.streamed(p, 4)
    # 0.4 s for 4 gaps: the 50 ms one has (0.8 - 0.4) / 12 a gap left, the 20 ms one nothing
    load = view.load_of(d, now=11.4)
    assert load.stream_allowances == pytest.approx((0.0, 0.4 / 12))
    assert load.stream_tpot_slo_s == pytest.approx(0.4 / 12)


@pytest.mark.parametrize(("allowances", "floor", "expected"), [
    ((0.0, 0.004, 0.012, 0.03), 0.009, (0.012, 2)),
    ((0.0, 0.004, 0.012, 0.03), 0.05, (math.inf, 4)),
    ((0.012, 0.03), 0.009, (0.012, 0)),
])
def test_the_objective_is_the_least_allowance_still_in_reach(allowances, floor, expected):
    assert stream_objective_s(replica("d1", stream_allowances=allowances), 0.05, floor) == expected


def test_without_allowances_the_workloads_objective_stands():
    assert stream_objective_s(replica("d1"), 0.05, 0.009) == (0.05, 0)
    # every known allowance past reach, one stream of three without one: it is held to the workload's
    beside_unknown = replica("d1", stream_allowances=(0.0, 0.004), num_streams=3)
    assert stream_objective_s(beside_unknown, 0.05, 0.009) == (0.05, 2)


def test_streams_without_a_known_allowance_still_count_where_the_others_are_past_reach():
    """Bench cluster, tight cell: six streams on the decode replica, five of them this
    router's and all five past reach. The sixth was held to an infinite objective, so a
    1,496-token prefill beside it that would stretch its gaps to 144 ms cost nothing and
    tied with remote (the prompt's own TPOT missed on both); a background prefill at the
    whole budget then held the replica for two seconds."""
    cpu = StepCoefficients(0.0155, 8.2e-4, 3.3e-7, 1.5e-3, 3e-6)
    d = replica("d1", coefficients=cpu, num_streams=6, stream_context=900, stream_tokens_left=16.0,
                stream_allowances=(0.0, 0.0, 0.0069, 0.0218, 0.0219), recent_gap_s=0.035, arrival_rate=2.7)
    context = ctx(prompt_len=1496, slo=SLO(ttft_ms=2966, tpot_ms=29.74), max_tokens=8, decode=d,
                  prefills=(replica("p1", "prefill", coefficients=cpu),))
    scored = {c.kind: score(context, c, c.prediction) for c in candidates(context)}
    assert scored["local"].candidate.prediction.streams_tpot_s > 0.1
    assert scored["local"].loss > scored["remote"].loss + 0.5
    # a background chunk is sized for that stream, not the whole budget, and waits far too long
    assert scored["background"].candidate.chunk_tokens < 64
    assert scored["background"].loss > scored["remote"].loss + 0.5
    assert decide(context).route == "disagg"


def _busy(allowances: tuple[float, ...]):
    """Eight streams at 9 ms a gap, allowed `allowances`."""
    return replica("d1", stream_allowances=allowances, **BUSY_STREAMS)


MIXED = (0.004,) + (0.012,) * 7  # one of them past reach beside a 9 ms gap


def test_one_stream_past_reach_no_longer_makes_every_route_break_the_others():
    """The table's tight-streams row (remote keeps them at their pace) with one of the
    eight streams already past reach: remote still meets for the seven; held to the one
    that cannot make it (a floor of 0), every route would break all eight."""
    decision = decide(ctx(decode=_busy(MIXED), slo=TIGHT))
    assert (decision.route, decision.reason, decision.candidate.kind) == ("disagg", "slo-disagg", "remote")
    assert decision.prediction.streams_tpot_s > 0.004
    assert stream_objective_s(_busy(MIXED), 0.05, 0.0) == (0.004, 0)
    # a foreground prefill of 2,000 tokens breaks the streams in reach, and only those count
    losses = {}
    for name, allowances in (("mixed", MIXED), ("all in reach", (0.012,) * 8)):
        context = ctx(prompt_len=2000, decode=_busy(allowances), slo=TIGHT)
        local = next(c for c in candidates(context) if c.kind == "local")
        scored = score(context, local, local.prediction)
        assert local.num_streams == 8 and not scored.meets
        losses[name] = scored.loss
    assert losses["all in reach"] > 0 and losses["mixed"] == pytest.approx(losses["all in reach"] * 7 / 8)


def test_a_background_chunk_is_sized_for_the_streams_still_in_reach():
    """Prefill pool saturated: the prompt prefills beside the streams at their pace, at the
    chunk that keeps the seven inside 12 ms, not at the one token that the stream past
    reach would allow."""
    decision = decide(ctx(decode=_busy(MIXED), slo=SLO(ttft_ms=3000, tpot_ms=12), prefills=SATURATED))
    assert (decision.candidate.kind, decision.reason) == ("background", "protect-streams")
    shape = RequestShape(1000, 32)
    assert decision.chunk_tokens == predict.background_chunk(shape, _busy(MIXED), 0.012) > 1
    assert predict.background_chunk(shape, _busy(MIXED), 0.004) == 1


def test_a_prompt_queued_ahead_decodes_beside_a_local_prefill_and_is_protected():
    """A long prompt queued ahead on the decode replica becomes a stream before a second
    one's chunks run: a local prefill would stall it past its objective, so the second
    goes remote; with nothing queued ahead, local is free."""
    slo = SLO(ttft_ms=5000, tpot_ms=15)
    alone = decide(ctx(prompt_len=2000, slo=slo, max_tokens=16))
    assert (alone.route, alone.candidate.kind) == ("local", "local")
    queued = replica("d1", queue_tokens=1500, queued_streams=1, queued_context=1500, queued_tokens_left=16.0,
                     stream_allowances=(0.015,))
    local = predict.local(ctx(prompt_len=2000).shape, queued, 0)
    assert local.num_streams == 1
    # four 511-token chunks of ~57 ms beside the queued stream's first 4 of 15 gaps
    assert local.prediction.streams_tpot_s == pytest.approx((4 * 0.0566 + 11 * 0.0055) / 15, rel=0.02)
    decision = decide(ctx(prompt_len=2000, slo=slo, decode=queued, max_tokens=16))
    assert (decision.route, decision.reason) == ("disagg", "slo-disagg")


def test_streams_that_spent_their_slack_are_held_to_what_is_left():
    """Eight streams with 40 tokens left at 9 ms a gap: a fresh 12 ms objective allows a short
    foreground prefill beside them (one 29 ms step, then 9.5 ms gaps with this request:
    10 ms a gap over what is left); streams whose earlier gaps left them 9.5 ms do not; streams already past reach are not
    protected at all."""
    from router.auto_policy import score

    streams = dict(BUSY_STREAMS, stream_tokens_left=40.0)

    def local_meets(allowance: float) -> bool:
        context = ctx(prompt_len=200, slo=SLO(ttft_ms=2000, tpot_ms=12),
                      decode=replica("d1", stream_allowances=(allowance,), **streams))
        local = predict.local(context.shape, context.decode, 0)
        assert local.prediction.streams_tpot_s == pytest.approx((0.029 + 39 * 0.0095) / 40, rel=0.02)
        return score(context, local, local.prediction).meets

    assert local_meets(0.012)
    assert not local_meets(0.0095)
    assert local_meets(0.0)  # past its budget already


def test_of_routes_that_all_meet_the_one_that_leaves_the_most_requests_a_margin_wins():
    """A live decision: a 1,496-token prompt (TTFT objective 5.8 s, TPOT 61 ms) beside six
    streams that can afford 127 ms a token. Every route meets. A background prefill keeps
    this request's TPOT 47% inside and leaves the streams 42%; remote leaves this request
    40% and the streams 71%. The tightest margin alone (leximin) took the background
    prefill, which then held the decode replica for 2.5 s; six streams' margin outweighs
    a few points of one request's."""
    from router.auto_policy import best, score
    from router.candidate import Candidate, Prediction

    context = ctx(prompt_len=1496, slo=SLO(ttft_ms=5758, tpot_ms=61),
                  decode=replica("d1", num_streams=6, stream_allowances=(0.1266,)))
    routes = {"background": Candidate("background", "d1", "d1", Prediction(2.224, 0.0324, 0.0739), 74, 6),
              "remote": Candidate("remote", "d1", "p1", Prediction(1.829, 0.0363, 0.0363), None, 6),
              "local": Candidate("local", "d1", "d1", Prediction(1.771, 0.0324, 0.0821), None, 6)}
    scored = {kind: score(context, c, c.prediction) for kind, c in routes.items()}
    assert all(s.meets and s.loss == 0.0 for s in scored.values())
    assert max(scored.values(), key=lambda s: s.slack).candidate.kind == "background"  # leximin's pick
    assert best(list(scored.values())).candidate.kind == "remote"
    # with no streams beside it, this request's own margins decide: the quicker local route
    alone = ctx(prompt_len=1496, slo=SLO(ttft_ms=5758, tpot_ms=61))
    lone = [score(alone, dataclasses.replace(c, num_streams=0), dataclasses.replace(c.prediction, streams_tpot_s=0.0))
            for kind, c in routes.items() if kind != "background"]
    assert best(lone).candidate.kind == "local"


def test_streams_stretched_by_recent_prompts_are_still_protected_from_the_next():
    """Eight streams whose gaps were 33 ms lately (prompts prefilled beside them), where
    the decode step alone is 9 ms, allowed 20 ms a token for the rest of their output:
    they make it if nothing more stalls them, so they are not past reach, and a
    1,500-token prompt prefills remote rather than beside them."""
    slo = SLO(ttft_ms=20_000, tpot_ms=26)
    stretched = replica("d1", stream_allowances=(0.020,) * 8, recent_gap_s=0.033, **BUSY_STREAMS)
    context = ctx(prompt_len=1500, slo=slo, decode=stretched)
    loss = {c.kind: score(context, c, c.prediction).loss for c in candidates(context)}
    # the streams' gap already runs past 20 ms: a route is charged what it adds to their
    # chance of missing, little for one more stream (remote), more for the prompt's chunks
    assert loss["local"] > loss["remote"] + 8 * 0.1
    assert 1.0 < loss["remote"] < 1.0 + 8 * 0.05
    decision = decide(context)
    assert (decision.route, decision.candidate.kind) == ("disagg", "remote")


def test_with_every_stream_past_reach_the_requests_about_to_join_keep_prompts_off_the_replica():
    """Eight streams all past reach (gaps stretched to 40 ms lately against a 26 ms
    objective): this request misses its TPOT on every route and costs those streams
    nothing. The requests arriving while its prompt runs there start with their whole
    budget: what its chunks add to their chance of missing is lost locally, and remote,
    where nothing stalls the replica, wins. With none arriving, the routes tie on loss
    and the quicker local route stands."""
    slo = SLO(ttft_ms=20_000, tpot_ms=26)

    def decided(arrival_rate: float):
        stretched = replica("d1", stream_allowances=(0.0,) * 8, recent_gap_s=0.040, arrival_rate=arrival_rate,
                            **BUSY_STREAMS)
        context = ctx(prompt_len=200, slo=slo, decode=stretched)
        scored = {c.kind: score(context, c, c.prediction) for c in candidates(context)}
        assert scored["remote"].loss == 1.0
        if arrival_rate:
            assert scored["local"].loss > scored["remote"].loss
        else:
            assert scored["local"].loss == 1.0  # a tie on loss
        return decide(context)

    quiet = decided(0.0)
    assert (quiet.route, quiet.candidate.kind, quiet.reason) == ("local", "local", "no-route-meets-slo")
    busy = decided(4.0)
    assert (busy.route, busy.candidate.kind, busy.reason) == ("disagg", "remote", "no-route-meets-slo")


def test_a_long_prompt_that_meets_on_both_routes_leaves_the_decode_replica_to_the_short_ones_arriving():
    """A 1,496-token prompt meets its objectives locally and remotely. Short requests with
    a 165 ms TTFT objective have been arriving at the decode replica at 4/s: in the
    foreground there, the prompt would hold them up for about half its prefill each, so it
    goes remote. With nothing arriving, or with arrivals whose objective is seconds away,
    local is free; a short prompt's own brief prefill stays local beside them too."""
    slo_long = SLO(ttft_ms=2380, tpot_ms=136)

    cpu = StepCoefficients(0.01, 8e-4, 0.0, 5e-4, 0.0)  # a prompt token costs 0.8 ms, as on the bench's CPU

    def decided(prompt_len: int, objectives: tuple[tuple[float, int], ...], slo: SLO = slo_long):
        arrivals = sum(n for _, n in objectives)
        d = replica("d1", coefficients=cpu, arrival_ttft_objectives=objectives, arrival_rate=arrivals / 10.0)
        return decide(ctx(prompt_len=prompt_len, slo=slo, decode=d, prefills=(replica("p1", "prefill", coefficients=cpu),)))

    quiet = decided(1496, ())
    assert (quiet.route, quiet.candidate.kind) == ("local", "local") and quiet.candidate.blocking_s > 0.1
    busy = decided(1496, ((0.165, 40),))
    assert (busy.route, busy.reason) == ("disagg", "slo-disagg")
    alternatives = {a.candidate.kind: a for a in busy.alternatives}
    # the prompt meets on both; locally, the arrivals more than 165 ms before its end miss
    local = alternatives["local"]
    assert local.meets and alternatives["remote"].loss == 0.0
    assert local.loss == pytest.approx(40 * (local.candidate.blocking_s - 0.165) / 10.0)
    assert decided(100, ((0.165, 40),), SLO(ttft_ms=165, tpot_ms=136)).candidate.kind == "local"


def test_the_view_lists_the_ttft_objective_of_each_request_placed_to_decode_there():
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([ReplicaInfo("d1", "decode")])
    local = WorkloadProfile(mode="local")
    for at, ttft_ms in ((1.0, 500), (2.0, 150)):
        inputs = PolicyInputs(slo=SLO(ttft_ms=ttft_ms, tpot_ms=50), now=at)
        view.begin(place(view, [1] * 40, 17, local, None, offload_to_prefill=False, inputs=inputs))
    d = view.replicas["d1"]
    assert view.load_of(d, now=3.0, arrival_objectives=True).arrival_ttft_objectives == ((0.15, 1), (0.5, 1))
    assert view.load_of(d, now=3.0).arrival_ttft_objectives == ()  # only where asked
    assert view.load_of(d, now=11.5, arrival_objectives=True).arrival_ttft_objectives == ((0.15, 1),)  # 10 s window


def test_a_remote_prefill_counts_the_request_running_whole_on_its_prefill_replica():
    # a request runs whole on the prefill replica: 15 tokens left, 74 ms a token to spare;
    # a prompt token costs 1 ms, as on the bench's CPU replicas
    cpu = StepCoefficients(0.02, 1e-3, 0.0, 5e-4, 0.0)
    host = replica("p1", "prefill", coefficients=cpu, num_streams=1, stream_context=1816,
                   stream_tokens_left=15.0, stream_allowances=(0.074,), num_requests=1)
    slo = SLO(ttft_ms=8000, tpot_ms=74)
    context = ctx(prompt_len=1915, slo=slo, max_tokens=16, decode=replica("d1", coefficients=cpu), prefills=(host,))
    remote = next(c for c in candidates(context) if c.kind == "remote")
    assert remote.host_streams == 1
    stalled = remote.prediction.host_streams_tpot_s
    alone = replica_steps.decode_step_s(host)
    assert stalled > 0.074 > alone  # its chunks stall the stream past what it can afford
    scored = score(context, remote, remote.prediction)
    assert not scored.meets and scored.loss > 0.0
    assert decide(context).route == "local"  # the decode replica is idle: the prompt prefills there
    # unless short requests keep arriving there (4/s, a 215 ms TTFT objective): in the
    # foreground for two seconds the prompt would hold up about seven of them, remote one
    arriving = replica("d1", coefficients=cpu, arrival_ttft_objectives=((0.215, 40),), arrival_rate=4.0)
    assert decide(dataclasses.replace(context, decode=arriving)).route == "disagg"
    # with nothing running on the prefill replica, the same prompt costs nobody there
    idle = dataclasses.replace(context, prefills=(replica("p1", "prefill", coefficients=cpu),))
    assert next(c for c in candidates(idle) if c.kind == "remote").prediction.host_streams_tpot_s == 0.0


def test_a_remote_prefill_counts_the_request_queued_to_run_whole_on_its_prefill_replica():
    """Bench cluster, load shift: the first long prompt was placed whole on the idle
    prefill replica; the next one, sent remote while the first still prefilled there,
    queued behind it and its chunks then stalled the first request's 16 tokens to 278 ms
    a token against 75. Queued, that request was no stream yet and cost the remote route
    nothing."""
    cpu = StepCoefficients(0.02, 1e-3, 0.0, 5e-4, 0.0)
    host = replica("p1", "prefill", coefficients=cpu, queue_tokens=1816, queue_work=1816 * 908,
                   queued_streams=1, queued_context=1816, queued_tokens_left=16.0,
                   stream_allowances=(0.075,), num_requests=1)
    slo = SLO(ttft_ms=8000, tpot_ms=75)
    context = ctx(prompt_len=1816, slo=slo, max_tokens=16, decode=replica("d1", coefficients=cpu),
                  prefills=(host,))
    remote = next(c for c in candidates(context) if c.kind == "remote")
    assert remote.host_streams == 1
    assert remote.prediction.host_streams_tpot_s > 0.075 > replica_steps.decode_step_s(host, 1, 1816)
    assert not score(context, remote, remote.prediction).meets
    assert decide(context).route == "local"  # the decode replica is idle: the prompt prefills there


def test_a_route_is_charged_only_the_misses_it_adds_to_the_streams():
    """Bench cluster, tight_tpot: the decode replica's streams decoded at 37-41 ms against
    a 29.74 ms objective whatever was routed. A remote prefill, which adds one stream
    there, was charged their whole overrun, lost to running the prompt whole on the prefill
    replica, and the remote prefills after it stalled that request to 300-460 ms a token."""
    slo = SLO(ttft_ms=20_000, tpot_ms=29.74)
    late = replica("d1", stream_allowances=(0.0264,) * 5, recent_gap_s=0.039, num_streams=5,
                   stream_context=5 * 150, stream_tokens_left=16.0)
    context = ctx(prompt_len=1496, slo=slo, max_tokens=8, decode=late)
    remote = next(c for c in candidates(context) if c.kind == "remote")
    untouched = replica_steps.expected_gap_s(late)
    assert untouched > 0.0264 and remote.prediction.streams_tpot_s > untouched
    scored = score(context, remote, remote.prediction)
    added = 5 * (remote.prediction.streams_tpot_s - untouched) / 0.0264
    assert scored.loss == pytest.approx(1.0 + added)  # its own miss, and what it adds
    # with room left in the streams' gap, the same route costs them nothing
    roomy = dataclasses.replace(context, decode=late.evolve(stream_allowances=(0.05,) * 5))
    assert score(roomy, remote, remote.prediction).loss == pytest.approx(1.0)


def test_streams_just_past_reach_still_lose_what_a_prompts_chunks_add():
    """Eight streams allowed 8.8 ms a token where the decode step alone is 9 ms: past
    reach on the prediction, yet a prediction lands a fifth off either way, so they still
    make it now and then. A 1,500-token prompt's chunks beside them (13 ms a token over
    the rest of their lives) ends that; remote (9.5 ms while it decodes beside them) costs
    them far less, and wins, though this request misses its TPOT on both. Streams with no
    budget left (allowance 0) are lost whatever happens: the routes tie on loss and the
    quicker local one stands."""
    slo = SLO(ttft_ms=20_000, tpot_ms=8.8)

    def scored(allowance: float) -> dict:
        near = replica("d1", stream_allowances=(allowance,) * 8, **BUSY_STREAMS)
        context = ctx(prompt_len=1500, slo=slo, decode=near)
        assert stream_objective_s(near, 0.0088, replica_steps.decode_step_s(near))[1] == 8  # all past reach
        return {c.kind: score(context, c, c.prediction) for c in candidates(context)}, decide(context)

    near, decision = scored(0.0088)
    assert not any(s.meets for s in near.values())
    assert near["local"].loss > near["remote"].loss + 8 * 0.3
    assert (decision.route, decision.candidate.kind, decision.reason) == ("disagg", "remote", "no-route-meets-slo")
    spent, decision = scored(0.0)
    assert spent["local"].loss == spent["remote"].loss == 1.0
    assert (decision.route, decision.candidate.kind) == ("local", "local")


def test_a_request_slows_the_streams_beside_it_only_while_it_decodes():
    """Eight streams with 40 tokens left: a request generating 8 tokens decodes beside
    them for 7 of their gaps and is gone for the other 33; one generating 64 outlasts
    them. The streams' predicted TPOT follows, on the remote route and on the local one
    after its prompt's chunks."""
    d = replica("d1", **BUSY_STREAMS)
    for max_tokens, beside in ((8, 7), (64, 40)):
        context = ctx(prompt_len=1500, max_tokens=max_tokens, decode=d)
        by_kind = {c.kind: c for c in candidates(context)}
        with_it, without = predict._gap_with(context.shape, d), replica_steps.expected_gap_s(d)
        assert with_it > without
        expected = (beside * with_it + (40 - beside) * without) / 40
        assert by_kind["remote"].prediction.streams_tpot_s == pytest.approx(expected)
    short, long_ = (ctx(prompt_len=1500, max_tokens=n, decode=d) for n in (8, 64))
    local = {n: predict.local(c.shape, d, 0).prediction.streams_tpot_s for n, c in ((8, short), (64, long_))}
    assert local[8] < local[64]
