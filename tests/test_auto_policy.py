"""The predictive `auto` policy as a table: every candidate, every reason, cold start,
the exploration bound, correction from measured outcomes, decay and reset; and, as a
property, that it never raises and never disaggregates without a healthy prefill replica."""

from __future__ import annotations

import dataclasses
import math
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.config import SLO, WorkloadProfile
from router import predict, replica_steps
from router.auto_policy import candidates, corrected, in_explore_bucket
from router.candidate import LONG_PROMPT_KEY, Candidate, Prediction, RequestShape
from router.corrections import EMPTY, PRIOR_SPREAD, Corrections, Outcome
from router.policy import RequestWork, RouteContext
from router.queue_drain import drain
from router.replica_load import ReplicaLoad
from router.routing import decide
from workers.engine.cost_model import StepCoefficients
from workers.engine.transfer_cost import TransferCoefficients
from workers.protocol import REASONS

# 5 ms a step, 0.1 ms a prompt token, 0.5 ms a decode sequence: a 1000-token prompt
# prefills in ~105 ms alone; a decode step with 8 streams takes 9 ms.
COEFFS = StepCoefficients(0.005, 1e-4, 0.0, 5e-4, 0.0)
FAST_LINK = {"*": TransferCoefficients(0.002, 1e9)}
SLOW_LINK = {"*": TransferCoefficients(0.8, 1e9)}
AUTO = WorkloadProfile(mode="auto")


def replica(rid: str, role: str = "decode", **kw) -> ReplicaLoad:
    base = {"coefficients": COEFFS, "chunk_tokens": 512, "kv_bytes_per_token": 4096,
            "address": f"tcp://{rid}", "transfers": FAST_LINK if role == "prefill" else {}}
    base.update(kw)
    return ReplicaLoad(rid, role, **base)


def ctx(prompt_len: int = 1000, slo: SLO = SLO(ttft_ms=2000, tpot_ms=50), decode: ReplicaLoad | None = None,
        prefills: tuple[ReplicaLoad, ...] | None = None, **kw) -> RouteContext:
    prefills = (replica("p1", "prefill"),) if prefills is None else prefills
    base = dict(prompt_len=prompt_len, num_cached_tokens=0, profile=AUTO, num_healthy_prefill=len(prefills),
                decode=decode or replica("d1"), prefills=prefills, prefill_cached_tokens=(0,) * len(prefills),
                max_tokens=32, slo=slo, request_id="req-1")
    base.update(kw)
    return RouteContext(**base)


BUSY_STREAMS = {"num_streams": 8, "stream_context": 8 * 600, "stream_tokens_left": 40.0}
TABLE = [
    # (name, context, expected route, reason, candidate kind)
    ("idle: local has no transfer to pay", ctx(), "local", "slo-local", "local"),
    ("short prompt, cold start", ctx(prompt_len=12), "local", "slo-local", "local"),
    ("streams with a tight TPOT: a foreground prefill would stall them; remote is free",
     ctx(decode=replica("d1", **BUSY_STREAMS), slo=SLO(ttft_ms=2000, tpot_ms=12)), "disagg", "slo-disagg", "remote"),
    ("the same, prefill pool saturated: prefill beside the streams at their pace",
     ctx(decode=replica("d1", **BUSY_STREAMS), slo=SLO(ttft_ms=3000, tpot_ms=12),
         prefills=(replica("p1", "prefill", queue_tokens=40_000),)), "local", "protect-streams", "background"),
    ("the same, no prefill replica", ctx(decode=replica("d1", **BUSY_STREAMS), slo=SLO(ttft_ms=3000, tpot_ms=12),
                                         prefills=(), num_healthy_prefill=0),
     "local", "prefill-unhealthy", "background"),
    ("decode replica has a long queue, an idle prefill replica runs it whole",
     ctx(decode=replica("d1", queue_tokens=20_000), prefills=(replica("p1", "prefill", transfers=SLOW_LINK),),
         whole=replica("p1", "prefill"), whole_cached_tokens=0), "local", "slo-local", "whole"),
    ("a slow link: the transfer tail costs more than the decode replica's queue",
     ctx(decode=replica("d1", queue_tokens=2_000), prefills=(replica("p1", "prefill", transfers=SLOW_LINK),)),
     "local", "slo-local", "local"),
    ("nothing can meet a 1 ms TTFT: least goodput lost", ctx(slo=SLO(ttft_ms=1, tpot_ms=50)),
     "local", "no-route-meets-slo", "local"),
    ("no room for the KV on the decode replica: not remote",
     ctx(decode=replica("d1", **BUSY_STREAMS), slo=SLO(ttft_ms=2000, tpot_ms=12), decode_has_room=False),
     "local", "decode-busy", "background"),
    ("the least-loaded of several prefill replicas",
     ctx(decode=replica("d1", **BUSY_STREAMS), slo=SLO(ttft_ms=2000, tpot_ms=12),
         prefills=(replica("p1", "prefill", queue_tokens=3000), replica("p2", "prefill"))),
     "disagg", "slo-disagg", "remote"),
]


@pytest.mark.parametrize(("name", "context", "route", "reason", "kind"), TABLE, ids=[t[0] for t in TABLE])
def test_decision_table(name, context, route, reason, kind):
    decision = decide(context)
    assert (decision.route, decision.reason, decision.candidate.kind) == (route, reason, kind), name
    assert decision.prediction.ttft_s > 0 and decision.prediction.tpot_s > 0
    if kind == "background":
        assert decision.yield_prefill and 1 <= decision.chunk_tokens <= 512
    if kind == "remote":
        assert decision.candidate.prefill_replica == ("p2" if len(context.prefills) == 2 else "p1")


def test_every_candidate_is_priced_and_ordered_as_expected():
    context = ctx(decode=replica("d1", **BUSY_STREAMS), whole=replica("p1", "prefill"))
    by_kind = {c.kind: c for c in candidates(context)}
    assert set(by_kind) == {"local", "background", "remote", "whole"}
    local, background = by_kind["local"].prediction, by_kind["background"].prediction
    assert background.ttft_s > local.ttft_s  # it yields to the streams...
    # ...and costs the streams no more over what they have left: under a step model with no
    # attention term the prompt's chunks stall them as long in total however they are cut
    assert background.streams_tpot_s <= local.streams_tpot_s
    assert by_kind["remote"].prediction.ttft_s > drain(replica("p1", "prefill"), predict.foreground(replica("p1", "prefill"), 0, 1000)).seconds
    assert by_kind["whole"].prediction.streams_tpot_s == 0.0


@pytest.mark.parametrize("mode", ["auto", "threshold", "local", "disagg"])
def test_every_mode_carries_a_prediction_for_the_route_it_takes(mode):
    decision = decide(ctx(profile=WorkloadProfile(mode=mode, min_remote_prefill_tokens=100)))
    assert decision.prediction is not None and decision.candidate.route == decision.route
    assert decision.prediction.ttft_s > 0


def test_cold_start_predicts_from_the_default_model():
    """A replica that has reported no model yet: the default coefficients, finite figures."""
    cold = ReplicaLoad("d1", "decode")
    decision = decide(ctx(decode=cold, prefills=(ReplicaLoad("p1", "prefill"),)))
    assert math.isfinite(decision.prediction.ttft_s) and decision.prediction.ttft_s > 0


# ---- exploration -----------------------------------------------------------------------

def test_the_exploration_bucket_is_at_most_two_percent_and_stable():
    ids = [f"req-{i}" for i in range(50_000)]
    share = sum(in_explore_bucket(i, 0.02) for i in ids) / len(ids)
    assert 0.015 < share <= 0.021
    assert not any(in_explore_bucket(i, 0.0) for i in ids[:2000])
    assert not in_explore_bucket("", 0.02)
    assert in_explore_bucket("req-7", 0.02) == (zlib.crc32(b"req-7") % 10_000 < 200)


def _explorer_id() -> str:
    return next(f"x-{i}" for i in range(10_000) if in_explore_bucket(f"x-{i}", 0.02))


def _measured(route: str, now: float) -> Corrections:
    c = Corrections()
    c.observe(Outcome(route, "d1" if route == "local" else "p1", "d1", 0.1, 0.1, 0.01, 0.01), now)
    return c


def test_a_stale_route_is_probed_only_where_both_routes_meet_the_slo():
    explorer = _explorer_id()
    fresh_local = _measured("local", now=100.0).snapshot()  # disagg never measured: stale
    probe = decide(ctx(request_id=explorer), fresh_local, now=100.0)
    assert (probe.route, probe.reason) == ("disagg", "explore")
    assert decide(ctx(request_id="not-in-bucket-0"), fresh_local, now=100.0).reason == "slo-local" \
        or not in_explore_bucket("not-in-bucket-0", 0.02)
    # disagg measured recently: not stale, no probe
    both = _measured("local", 100.0)
    both.observe(Outcome("disagg", "p1", "d1", 0.1, 0.1), 100.0)
    assert decide(ctx(request_id=explorer), both.snapshot(), now=101.0).reason == "slo-local"
    # the other route cannot meet the SLO: never probed
    hopeless = ctx(request_id=explorer, prefills=(replica("p1", "prefill", transfers={"*": TransferCoefficients(5.0, 1e9)}),))
    assert decide(hopeless, fresh_local, now=100.0).reason == "slo-local"


# ---- correction ------------------------------------------------------------------------

def _learn_slow_disagg(corrections: Corrections, ratio: float, now: float, times: int = 3) -> None:
    """Long prompts (as `ctx`'s 1,000 tokens are) that came in `ratio` times their predicted TTFT."""
    for _ in range(times):
        corrections.observe(Outcome("disagg", "p1", "d1", 0.1, 0.1 * ratio, 0.01, 0.01,
                                    ttft_learned_as="disagg" + LONG_PROMPT_KEY), now)


def test_slow_disaggregated_outcomes_shift_routing_local_and_back_when_they_fade():
    busy = ctx(decode=replica("d1", **BUSY_STREAMS), slo=SLO(ttft_ms=400, tpot_ms=16),
               prefills=(replica("p1", "prefill"),))
    assert decide(busy, EMPTY, now=0.0).route == "disagg"
    corrections = Corrections(half_life_s=30.0)
    assert decide(busy, corrections.snapshot(), now=0.0).route == "disagg"  # under the prior spread too
    _learn_slow_disagg(corrections, ratio=8.0, now=10.0)
    state = corrections.snapshot()
    assert 4.0 < state.factor("ttft", "disagg:long", "p1", 10.0) <= 8.0  # the first samples are weighed in gently
    after = decide(busy, state, now=10.0)
    assert after.route == "local" and after.prediction.ttft_s > 0
    # the evidence fades with no new measurement: the model's view comes back
    assert decide(busy, state, now=10.0 + 10 * 30.0).route == "disagg"


def test_a_correction_rescales_the_headers_prediction():
    corrections = Corrections()
    corrections.observe(Outcome("local", "d1", "d1", 0.1, 0.15, 0.010, 0.012, ttft_learned_as="local:long"), now=0.0)
    only_local = ctx(prefills=(), num_healthy_prefill=0)
    raw = decide(only_local, EMPTY, now=0.0)
    fixed = decide(only_local, corrections.snapshot(), now=0.0)
    state = corrections.snapshot()
    assert 1.0 < state.factor("ttft", "local:long", "d1", 0.0) < 1.5  # a first sample moves it half way (log scale)
    assert fixed.prediction.ttft_s == pytest.approx(raw.prediction.ttft_s * state.factor("ttft", "local:long", "d1", 0.0))
    assert fixed.prediction.tpot_s == pytest.approx(raw.prediction.tpot_s * state.factor("tpot", "local", "d1", 0.0))


def test_background_prefills_are_corrected_apart_from_foreground_ones():
    """Foreground local requests that came in at a third of their prediction leave a
    background prefill's prediction alone, and the reverse; both count as the local route
    (its residuals, its last measurement)."""
    corrections = Corrections()
    for _ in range(6):
        corrections.observe(Outcome("local", "d1", "d1", 0.3, 0.1, 0.030, 0.015), now=0.0)
    state = corrections.snapshot()
    assert state.factor("ttft", "local", "d1", 0.0) < 0.4 and state.factor("tpot", "local", "d1", 0.0) < 0.6
    assert state.factor("ttft", "background", "d1", 0.0) == state.factor("tpot", "background", "d1", 0.0) == 1.0
    # more than one background chunk, fewer tokens than a long prompt's TTFT is learned apart at
    context = ctx(prompt_len=400, decode=replica("d1", **BUSY_STREAMS))
    by_kind = {c.kind: c for c in candidates(context)}
    background = by_kind["background"]
    assert background.yields and background.ttft_learned_as == "background"
    assert background.learned_as == "background" and by_kind["local"].learned_as == "local"
    assert corrected(background, state, 0.0) == background.prediction
    assert corrected(by_kind["local"], state, 0.0).ttft_s < 0.4 * by_kind["local"].prediction.ttft_s
    corrections.observe(Outcome("local", "d1", "d1", 1.0, 3.0, 0.02, 0.04, learned_as="background"), now=1.0)
    state = corrections.snapshot()
    assert state.factor("ttft", "background", "d1", 1.0) > 1.5
    assert state.factor("ttft", "local", "d1", 1.0) < 0.4  # untouched by the background outcome
    assert len(state.residuals["ttft", "local"]) == 7 and not state.stale("local", 1.0, 0.5)


def test_the_transfer_tail_is_left_to_the_links_own_fit():
    """A TTFT factor rescales the step-model part only: a link predicted slow that turned
    out fast teaches it nothing, and once a slowed link's fit has caught up the factor
    learned while it lagged does not count the link twice."""
    c = Corrections()
    for _ in range(3):  # predicted 17 s of tail from an old fault, measured 0.7 s
        c.observe(Outcome("disagg", "p1", "d1", 18.0, 0.7, predicted_transfer_s=17.0), now=0.0)
    assert c.snapshot().factor("ttft", "disagg", "p1", 0.0) == 1.0
    lagging = Corrections()  # the link slowed; its fit still says 20 ms
    lagging.observe(Outcome("disagg", "p1", "d1", 1.3, 7.5, predicted_transfer_s=0.02,
                            ttft_learned_as="disagg" + LONG_PROMPT_KEY), now=0.0)
    factor = lagging.snapshot().factor("ttft", "disagg" + LONG_PROMPT_KEY, "p1", 0.0)
    assert factor > 2.0
    remote = ctx(decode=replica("d1", **BUSY_STREAMS), slo=SLO(ttft_ms=60_000, tpot_ms=12))
    raw = decide(remote, EMPTY, now=0.0)
    fixed = decide(remote, lagging.snapshot(), now=0.0)
    tail = raw.candidate.prediction.transfer_s
    assert raw.route == fixed.route == "disagg" and tail > 0
    assert fixed.prediction.ttft_s == pytest.approx((raw.prediction.ttft_s - tail) * factor + tail)


def test_when_every_route_misses_the_one_that_misses_by_less_wins_over_sparing_the_streams():
    """Own TTFT missed everywhere: 5x late behind a prefill queue, or 1.5x late beside
    three streams it nudges 20% past their TPOT. Sending it to the queue would spare the
    streams but lengthen a backlog that every later remote request waits behind."""
    from router.auto_policy import OVERLOAD_WEIGHT, best, score

    c = ctx(slo=SLO(ttft_ms=2000, tpot_ms=50), max_tokens=1)
    queued = Candidate("remote", "d1", "p1", Prediction(10.0, 0.02, 0.0))
    beside = Candidate("local", "d1", "d1", Prediction(3.0, 0.02, 0.06), num_streams=3)
    scored = [score(c, queued, queued.prediction), score(c, beside, beside.prediction)]
    assert not any(s.meets for s in scored)
    assert scored[0].loss == pytest.approx(1.0 + OVERLOAD_WEIGHT * 4.0)
    assert scored[1].loss == pytest.approx(1.0 + OVERLOAD_WEIGHT * 0.5 + 3 * 0.2)
    assert best(scored).candidate is beside


def test_smoothing_bounds_and_reset():
    c = Corrections()
    c.observe(Outcome("local", "d1", "d1", 0.1, 1e6), now=0.0)  # one absurd sample is clamped
    assert c.snapshot().factor("ttft", "local", "d1", 0.0) <= 8.0
    for _ in range(30):
        c.observe(Outcome("local", "d1", "d1", 0.1, 0.2), now=1.0)
    assert c.snapshot().factor("ttft", "local", "d1", 1.0) == pytest.approx(2.0, rel=0.01)
    assert not c.snapshot().stale("local", 1.0, 20.0) and c.snapshot().stale("disagg", 1.0, 20.0)
    c.observe(Outcome("local", "d1", "d1", 0.0, 0.2), now=2.0)  # a zero prediction teaches nothing
    c.reset()
    assert c.snapshot().factor("ttft", "local", "d1", 2.0) == 1.0 and c.by_replica(2.0) == {}


def test_decide_is_pure():
    context, state = ctx(decode=replica("d1", **BUSY_STREAMS)), _measured("local", 5.0).snapshot()
    assert decide(context, state, now=5.0) == decide(context, state, now=5.0)


# ---- properties ------------------------------------------------------------------------

loads = st.builds(
    lambda rid, role, q, streams, left, c0, c1, c3, bpt: ReplicaLoad(
        rid, role, StepCoefficients(c0, c1, 0.0, c3, 0.0), 512, queue_tokens=q, queue_work=q * 100,
        num_streams=streams, stream_context=streams * 300, stream_tokens_left=left, kv_bytes_per_token=bpt),
    st.sampled_from(["a", "b", "c"]), st.sampled_from(["prefill", "decode"]), st.integers(0, 100_000),
    st.integers(0, 64), st.floats(0, 2000), st.floats(0, 1), st.floats(0, 1e-2), st.floats(0, 1e-2),
    st.integers(0, 1 << 20))


@settings(max_examples=300, deadline=None)
@given(prompt_len=st.integers(1, 8192), cached=st.integers(0, 8192), max_tokens=st.integers(1, 4096),
       decode=loads, prefills=st.lists(loads, max_size=4), healthy=st.integers(0, 4), room=st.booleans(),
       ttft=st.floats(0.01, 1e6), tpot=st.floats(0.01, 1e6), n=st.integers(1, 8), logprobs=st.booleans(),
       mode=st.sampled_from(["auto", "threshold", "local", "disagg"]), now=st.floats(0, 1e6),
       whole=st.none() | loads)
def test_never_raises_and_never_disaggregates_without_a_healthy_prefill(
        prompt_len, cached, max_tokens, decode, prefills, healthy, room, ttft, tpot, n, logprobs, mode, now, whole):
    num_healthy = min(healthy, len(prefills))
    context = RouteContext(
        prompt_len=prompt_len, num_cached_tokens=min(cached, prompt_len - 1), profile=WorkloadProfile(mode=mode),
        num_healthy_prefill=num_healthy, decode_has_room=room, max_tokens=max_tokens,
        slo=SLO(ttft_ms=ttft, tpot_ms=tpot), decode=decode, prefills=tuple(prefills[:num_healthy]),
        prefill_cached_tokens=(0,) * num_healthy, whole=whole, request_id=f"r{prompt_len}",
        work=RequestWork(num_sequences=n, prompt_logprobs=logprobs))
    corrections = Corrections()
    corrections.observe(Outcome("disagg", "a", "b", 0.1, 0.3, 0.01, 0.02), now)
    decision = decide(context, corrections.snapshot(), now)
    assert decision.reason in REASONS
    if num_healthy == 0:
        assert decision.route == "local"
    if decision.prediction is not None:
        assert math.isfinite(decision.prediction.ttft_s) and decision.prediction.ttft_s >= 0
        assert math.isfinite(decision.prediction.tpot_s) and decision.prediction.tpot_s >= 0


def test_predictions_also_where_a_fixed_mode_overrides_room_or_no_decode_replica_is_left():
    forced = decide(ctx(profile=WorkloadProfile(mode="disagg"), decode_has_room=False))
    assert forced.route == "disagg" and forced.prediction is not None
    from router.cluster_view import ClusterView, ReplicaInfo
    from router.placement import place

    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([ReplicaInfo("p1", "prefill")])
    whole = place(view, list(range(40)), 8, AUTO, None)
    assert whole.deployment == "prefill" and whole.decision.prediction.ttft_s > 0


def test_a_route_whose_outcomes_spread_wide_is_weighed_by_its_chance_of_meeting_the_slo():
    """Both routes meet a 400 ms TTFT by their predictions and remote has more slack; once
    remote's outcomes are seen to land at a third or three times their prediction and
    local's on it, local is the better bet."""
    from router.corrections import MIN_RESIDUALS

    both = ctx(decode=replica("d1", queue_tokens=2000), slo=SLO(ttft_ms=400, tpot_ms=50))
    assert decide(both, EMPTY, now=0.0).route == "disagg"
    c = Corrections()
    for i in range(MIN_RESIDUALS - 1):
        c.observe(Outcome("disagg", "p1", "d1", 0.1, 0.05 if i % 2 else 0.25), now=0.0)
        c.observe(Outcome("local", "d1", "d1", 0.1, 0.1), now=0.0)
    few = c.snapshot()
    # too few: the prior spread (a prediction at half the objective is twice as far as a sigma of 0.3 allows)
    assert few.chance_within("ttft", "disagg", 0.1, 0.2, 0.0) == pytest.approx(
        0.5 * (1 + math.erf(math.log(2.0) / PRIOR_SPREAD / math.sqrt(2))))
    assert dataclasses.replace(few, prior_spread=0.0).chance_within("ttft", "disagg", 0.1, 0.2, 0.0) is None
    assert decide(both, few, now=0.0).route == "disagg"
    c.observe(Outcome("disagg", "p1", "d1", 0.1, 0.05), now=0.0)
    c.observe(Outcome("local", "d1", "d1", 0.1, 0.1), now=0.0)
    state = c.snapshot()
    assert state.chance_within("ttft", "disagg", 0.1, 0.15, 0.0) == pytest.approx(0.5)
    assert state.chance_within("ttft", "disagg", 0.1, 1.0, 0.0) == 1.0
    assert state.chance_within("ttft", "local", 0.1, 0.09, 0.0) == 0.0
    chosen = decide(both, state, now=0.0)
    assert (chosen.route, chosen.reason) == ("local", "slo-local")
    # a route unmeasured for a half-life is judged by its prediction and the prior spread again
    assert state.chance_within("ttft", "disagg", 0.1, 0.15, state.half_life_s + 1.0) == pytest.approx(
        few.chance_within("ttft", "disagg", 0.1, 0.15, 0.0))
    assert decide(both, state, now=state.half_life_s + 1.0).route == "disagg"
    c.reset()
    assert c.snapshot().residuals == {}


NODE_STREAMS = {"num_streams": 8, "stream_context": 8 * 600, "stream_tokens_left": 8.0}


def test_a_prefill_replica_on_the_streams_own_node_slows_them_as_a_local_prefill_would():
    shared = dataclasses.replace(COEFFS, node_contention=2.0)
    d = replica("d1", coefficients=shared, node_id="n1", **NODE_STREAMS)
    apart = replica("p1", "prefill", coefficients=shared, node_id="n2")
    beside = replica("p1", "prefill", coefficients=shared, node_id="n1")
    slo = SLO(ttft_ms=2000, tpot_ms=12)
    assert decide(ctx(decode=d, prefills=(apart,), slo=slo)).route == "disagg"
    decision = decide(ctx(decode=d, prefills=(beside,), slo=slo))
    assert (decision.route, decision.reason, decision.candidate.kind) == ("local", "protect-streams", "background")
    far, near = (predict.remote(RequestShape(1000, 32), p, d, 0, 0).prediction for p in (apart, beside))
    assert near.streams_tpot_s > far.streams_tpot_s and near.ttft_s >= far.ttft_s
    alone = replica("d1", node_id="n1", **NODE_STREAMS)  # no contention learned: the node changes nothing
    assert (predict.remote(RequestShape(1000, 32), replica("p1", "prefill", node_id="n1"), alone, 0, 0)
            == predict.remote(RequestShape(1000, 32), replica("p1", "prefill", node_id="n2"), alone, 0, 0))


def test_one_more_busy_neighbour_slows_a_replica_by_its_share():
    shared = dataclasses.replace(COEFFS, node_contention=0.5)
    quiet = replica("d1", coefficients=shared, node_id="n1")
    assert replica_steps.added_contention(quiet, 0.0) == 1.0
    assert replica_steps.added_contention(quiet, 1.0) == pytest.approx(1.5)
    crowded = replica("d1", coefficients=shared.slowed(1.0), node_id="n1", node_busy=1.0)  # as ClusterView builds it
    assert replica_steps.added_contention(crowded, 1.0) == pytest.approx(2.0 / 1.5)  # 1 + 0.5 x 2 over 1 + 0.5 x 1


def test_a_decode_replica_whose_steps_cost_nothing_still_prices_a_remote_prefill():
    free = StepCoefficients(0.0, 0.0, 0.0, 0.0, 0.0)
    d = replica("d1", coefficients=free, queue_tokens=1, queue_work=100)  # a queued step priced at 0 s
    candidate = predict.remote(RequestShape(1, 1), replica("p1", "prefill", coefficients=free), d, 0, 0)
    assert candidate.prediction.tpot_s >= 0.0

