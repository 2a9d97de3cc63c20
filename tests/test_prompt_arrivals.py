"""The prompts that keep arriving at a replica stretch the gaps of a stream decoding
there: the prompt-token rate and the recent prompts the router's view keeps, the gap it
prices, the chance a long one lands mid-decode, and the decisions they change (a request
run whole on a prefill replica that keeps getting remote prefills, or long ones)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cluster.config import SLO
from router import replica_steps
from router.arrival_rate import MAX_KEPT, ArrivalRate
from router.arrival_rate import WINDOW_S as ARRIVAL_WINDOW_S
from router.burst_risk import burst_miss_chance
from router.candidate import RequestShape
from router.routing import decide
from tests.test_auto_policy import COEFFS, ctx, replica


def test_a_weighted_rate_sums_the_weights_of_the_window():
    rate = ArrivalRate(window_s=10.0)
    for i in range(20):
        rate.add("p1", 0.5 * i, 100.0)  # 200 tokens/s for 10 s
    assert rate.rate("p1", 10.0) == pytest.approx(200.0)
    assert rate.rate("p1", 15.0) == pytest.approx(100.0)  # half have left the window
    assert rate.rate("p1", 30.0) == 0.0
    rate.add("p1", 31.0, 50.0)
    assert rate.rate("p1", 31.0) == pytest.approx(5.0)  # nothing of the old ones is left in the sum


def test_the_oldest_placement_past_the_cap_leaves_the_sum_too():
    rate = ArrivalRate(window_s=1000.0)
    for i in range(MAX_KEPT + 10):
        rate.add("d1", float(i), 1.0 if i < 10 else 2.0, tag=0.1 if i < 10 else 0.2)
    assert rate.rate("d1", float(MAX_KEPT + 10)) == pytest.approx(2.0 * MAX_KEPT / 1000.0)
    assert rate.tag_counts("d1", float(MAX_KEPT + 10)) == ((0.2, MAX_KEPT),)  # and its tag's count


def test_a_tag_is_counted_per_placement_and_never_summed():
    rate = ArrivalRate(window_s=10.0)
    rate.add("d1", 0.0, tag=math.inf)  # a request without a TTFT objective
    rate.add("d1", 5.0, tag=0.25)
    rate.add("d1", 5.5, tag=0.25)
    rate.add("d1", 6.0)  # untagged
    assert rate.tag_counts("d1", 6.0) == ((0.25, 2), (math.inf, 1))
    assert rate.rates("d1", 6.0) == (pytest.approx(0.4),)
    assert rate.tag_counts("d1", 12.0) == ((0.25, 2),)  # the first has left the window
    assert rate.rates("d1", 12.0) == (pytest.approx(0.3),)
    assert rate.recent("d1", 12.0) == ((1.0,), (1.0,), (1.0,))
    assert rate.tag_counts("d1", 15.7) == ()
    assert rate.tag_counts("nowhere", 0.0) == ()


def test_the_view_counts_the_prompt_tokens_placed_to_be_computed_on_a_replica():
    from router.cluster_view import ClusterView, ReplicaInfo
    from router.placement import Placement
    from router.policy import RouteDecision

    view = ClusterView(16, 8)
    d1, p1 = ReplicaInfo("d1", "decode"), ReplicaInfo("p1", "prefill")
    view.update([d1, p1])
    for i in range(20):  # odd ones prefill remotely on p1, even ones locally on d1
        remote = bool(i % 2)
        view.begin(Placement("decode", "d1", "p1" if remote else None,
                             RouteDecision("disagg" if remote else "local", "slo-local"), 0,
                             prefill_on="p1" if remote else "d1", prefill_tokens=1000 if remote else 100,
                             prefill_work=7 if remote else 3, placed_at=float(i)))
    at_p1, at_d1 = view.load_of(p1, now=20.0), view.load_of(d1, now=20.0)
    assert at_p1.prompt_token_rate == pytest.approx(500.0) and at_p1.prompt_work_rate == pytest.approx(3.5)
    assert at_d1.prompt_token_rate == pytest.approx(50.0) and at_d1.prompt_work_rate == pytest.approx(1.5)
    assert at_p1.prompt_rate == pytest.approx(0.5) and at_d1.prompt_rate == pytest.approx(0.5)  # prompts a second
    assert view.load_of(p1).prompt_token_rate == 0.0  # without the policy's clock: no rate
    assert view.load_of(p1).prompt_rate == 0.0


def test_a_stream_where_prompts_keep_arriving_waits_for_their_chunks():
    quiet = replica("p1", "prefill")
    busy = dataclasses.replace(quiet, prompt_token_rate=5000.0)  # half its time at 0.1 ms a token
    assert replica_steps.prompt_share(quiet) == 0.0 and replica_steps.prompt_share(busy) == pytest.approx(0.5)
    assert replica_steps.expected_gap_s(busy, 1, 100) == pytest.approx(2.0 * replica_steps.expected_gap_s(quiet, 1, 100))
    saturated = dataclasses.replace(quiet, prompt_token_rate=1e9)
    assert replica_steps.prompt_share(saturated) == replica_steps.MAX_PROMPT_SHARE
    # streams that saw gaps lately: those were in steps that only decoded, so they stretch too
    seen = dataclasses.replace(busy, num_streams=1, stream_context=100, recent_gap_s=0.02)
    blended = replica_steps.NOW_WEIGHT * replica_steps.decode_step_s(seen) + (1 - replica_steps.NOW_WEIGHT) * 0.02
    assert replica_steps.expected_gap_s(seen) == pytest.approx(2.0 * blended)
    assert replica_steps.expected_gap_s(dataclasses.replace(seen, prompt_token_rate=0.0)) == pytest.approx(blended)


def test_a_request_is_not_run_whole_where_remote_prefills_keep_arriving():
    """The decode replica's long queue makes local slow; an idle prefill replica runs the
    request whole while nothing else is sent there, but not when remote prefills arrive
    at 90% of its time: its gaps would be ten times a decode step."""
    slo = SLO(ttft_ms=4000, tpot_ms=20)
    decode = replica("d1", queue_tokens=20_000)

    def route(prompt_rate: float) -> str:
        p1 = replica("p1", "prefill", prompt_token_rate=prompt_rate)
        return decide(ctx(slo=slo, decode=decode, prefills=(p1,), whole=p1, whole_cached_tokens=0)).candidate.kind

    assert COEFFS.prefill_token_s * 9000.0 == pytest.approx(0.9)
    assert route(0.0) == "whole"
    assert route(9000.0) != "whole"


def test_the_view_keeps_each_prompt_placed_on_a_replica_over_the_window():
    from router.cluster_view import ClusterView, ReplicaInfo
    from router.placement import Placement
    from router.policy import RouteDecision

    view = ClusterView(16, 8)
    d1, p1 = ReplicaInfo("d1", "decode"), ReplicaInfo("p1", "prefill")
    view.update([d1, p1])
    for at, tokens in ((0.0, 1500), (6.0, 90), (9.0, 1400)):
        view.begin(Placement("decode", "d1", "p1", RouteDecision("disagg", "slo-disagg"), 0, prefill_on="p1",
                             prefill_tokens=tokens, prefill_work=tokens // 10, placed_at=at))
    assert view.load_of(p1, now=9.5, recent_prompts=True).recent_prompts == ((1500, 150), (90, 9), (1400, 140))
    assert view.load_of(p1, now=12.0, recent_prompts=True).recent_prompts == ((90, 9), (1400, 140))  # one left
    assert view.load_of(d1, now=12.0, recent_prompts=True).recent_prompts == ()
    assert view.load_of(p1, recent_prompts=True).recent_prompts == ()  # no clock
    assert view.load_of(p1, now=12.0).recent_prompts == ()  # not asked for: only the whole candidate reads them


@pytest.mark.parametrize("name, recent, tpot_s, max_tokens, num_long", [
    ("nothing arrived", (), 0.010, 32, 0),
    ("short prompts only", ((100.0, 0.0),) * 20, 0.010, 32, 0),  # 10 ms each against 310 ms of slack
    ("one long prompt", ((100.0, 0.0), (5000.0, 0.0)), 0.010, 32, 1),  # 500 ms
    ("long by its attention", ((1000.0, 4000.0),), 0.010, 32, 1),  # 100 ms + 400 ms
    ("two long prompts", ((5000.0, 0.0), (4000.0, 0.0)), 0.010, 32, 2),
    ("already missing", ((5000.0, 0.0),), 0.025, 32, 0),  # the prediction prices it
    ("one token", ((5000.0, 0.0),), 0.010, 1, 0),
])
def test_the_chance_that_a_long_prompt_lands_while_a_request_decodes(name, recent, tpot_s, max_tokens, num_long):
    coefficients = dataclasses.replace(COEFFS, prefill_attention_s=1e-4)
    r = replica("p1", "prefill", coefficients=coefficients, recent_prompts=recent)
    req = RequestShape(prompt_len=10, max_tokens=max_tokens)  # itself far too short to stall anyone
    exposed_s = (max_tokens - 1) * tpot_s
    expected = 1.0 - math.exp(-num_long / ARRIVAL_WINDOW_S * exposed_s)
    assert burst_miss_chance(req, r, tpot_s, 0.020) == pytest.approx(expected)
    assert (expected > 0) == (num_long > 0)


def test_a_long_prompt_counts_itself_among_the_long_prompts_arriving():
    """It has just arrived: the first long prompt after a spell of short ones is evidence
    that more may follow, where the window alone holds none yet."""
    r = replica("p1", "prefill", coefficients=COEFFS, recent_prompts=((100.0, 0.0),) * 5)
    exposed_s = 31 * 0.010
    long_one = RequestShape(prompt_len=5000, max_tokens=32)  # 500 ms against 310 ms of slack
    assert burst_miss_chance(long_one, r, 0.010, 0.020) == pytest.approx(
        1.0 - math.exp(-1 / ARRIVAL_WINDOW_S * exposed_s))
    assert burst_miss_chance(dataclasses.replace(long_one, prompt_len=100), r, 0.010, 0.020) == 0.0


def test_a_request_is_not_run_whole_where_long_prompts_land():
    """Local meets the SLO but is slower to the first token: an idle prefill replica runs
    the request whole while only short prompts arrive there, not once long ones do (three
    8,000-token prompts in the last 10 s: one landing mid-decode stalls it 0.8 s, past the
    0.45 s of slack its 31 gaps leave)."""
    slo = SLO(ttft_ms=4000, tpot_ms=20)
    decode = replica("d1", queue_tokens=20_000)

    def decision(recent: tuple[tuple[float, float], ...]):
        p1 = replica("p1", "prefill", recent_prompts=recent)
        return decide(ctx(slo=slo, decode=decode, prefills=(p1,), whole=p1, whole_cached_tokens=0))

    assert decision(((100.0, 0.0),) * 5).candidate.kind == "whole"
    chosen = decision(((8000.0, 0.0),) * 3)
    assert chosen.candidate.kind == "local"
    whole = next(a for a in chosen.alternatives if a.candidate.kind == "whole")
    assert whole.meets and whole.loss == pytest.approx(1.0 - math.exp(-0.3 * 31 * whole.prediction.tpot_s))


def test_the_whole_candidate_sees_the_prompts_placed_on_its_replica_lately():
    """Through `place`: three remote prefills done on p1 (idle again, their requests still
    decoding on d1), so p1 is offered to run the next request whole, and that candidate's
    load carries the prompts p1 computed in the window; the decode replica's does not."""
    from cluster.config import WorkloadProfile
    from router.cluster_view import ClusterView, ReplicaInfo
    from router.placement import Placement, PolicyInputs, place
    from router.policy import RouteDecision

    view = ClusterView(16, 8)
    d1, p1 = ReplicaInfo("d1", "decode"), ReplicaInfo("p1", "prefill")
    view.update([d1, p1])
    for at, tokens in ((0.0, 1500), (6.0, 90), (9.0, 1400)):
        placed = Placement("decode", "d1", "p1", RouteDecision("disagg", "slo-disagg"), 0, prefill_on="p1",
                           prefill_tokens=tokens, prefill_work=tokens // 10, placed_at=at)
        view.begin(placed)
        view.prefill_done(placed, now=at + 0.2, num_tokens=1)
    assert view.load(p1) == 0 and view.load(d1) > 0
    placement = place(view, [7] * 40, 16, WorkloadProfile(mode="auto"), None, inputs=PolicyInputs(now=9.5),
                      keep_context=True)
    context = placement.context
    assert context.whole is not None and context.whole.replica_id == "p1"
    assert context.whole.recent_prompts == ((1500, 150), (90, 9), (1400, 140))
    assert context.decode.recent_prompts == ()
