"""A prompt in a replica's foreground lane holds up the prompts that arrive there after
it: the requests expected to miss their TTFT objective behind its chunks count as goodput
the candidate loses."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.config import SLO
from router import predict
from router.auto_policy import candidates
from router.cluster_view import ClusterView, ReplicaInfo
from router.placement import Placement
from router.policy import RouteDecision
from router.routing import decide
from tests.test_auto_policy import ctx, replica


def test_those_arriving_in_the_first_own_time_less_their_slack_miss():
    r = replica("d1", prefill_rate=4.0, prefill_ttft_slo_s=0.4)
    assert predict.pushed_past(r, 1.2) == pytest.approx(4.0 * (1.2 - predict.BEHIND_SLACK * 0.4))
    assert predict.pushed_past(r, 0.1) == 0.0  # a short prompt: they wait less than their slack
    assert predict.pushed_past(replica("d1"), 5.0) == 0.0  # nothing arrives


def test_the_view_keeps_the_rate_and_the_harmonic_mean_objective_of_prompts_placed_per_replica():
    view = ClusterView(16, 8)
    d1 = ReplicaInfo("d1", "decode")
    view.update([d1, ReplicaInfo("p1", "prefill")])
    for i in range(10):  # 9 with a 0.4 s objective, 1 with 6 s: the tight ones set it
        view.begin(Placement("decode", "d1", None, RouteDecision("local", "slo-local"), 0, prefill_on="d1",
                             prefill_tokens=100, ttft_slo_s=6.0 if i == 0 else 0.4, placed_at=float(i)))
    load = view.load_of(d1, now=10.0)
    assert load.prefill_rate == pytest.approx(1.0)
    assert load.prefill_ttft_slo_s == pytest.approx(10 / (9 / 0.4 + 1 / 6.0))
    assert view.load_of(view.replicas["p1"], now=10.0).prefill_rate == 0.0
    assert view.load_of(d1).prefill_rate == 0.0  # without the policy's clock


def test_a_long_prompt_yields_the_foreground_to_the_short_ones_arriving_behind_it():
    """The decode replica's streams have room and the prompt meets its own objectives in the
    foreground, but short requests arrive at 4/s with 0.4 s objectives: behind its chunks
    about two of them would miss theirs, so it prefills in the background."""
    slo = SLO(ttft_ms=8000, tpot_ms=100)
    quiet = replica("d1", num_streams=4, stream_context=400, stream_tokens_left=30.0)
    busy = dataclasses.replace(quiet, prefill_rate=4.0, prefill_ttft_slo_s=0.4)
    by_kind = {c.kind: c for c in candidates(ctx(prompt_len=6000, slo=slo, decode=busy, prefills=(),
                                                 num_healthy_prefill=0))}
    assert by_kind["local"].pushed_past > 1.0 and by_kind["background"].pushed_past == 0.0

    def kind(d) -> str:
        return decide(ctx(prompt_len=6000, slo=slo, decode=d, prefills=(), num_healthy_prefill=0)).candidate.kind

    assert kind(quiet) == "local"
    assert kind(busy) == "background"


def test_a_remote_prefill_is_charged_for_the_remote_prefills_behind_it():
    p = replica("p1", "prefill", prefill_rate=2.0, prefill_ttft_slo_s=0.5)
    remote = predict.remote(predict.RequestShape(6000, 16), p, replica("d1"), 0, 0)
    own_s = predict.drain(p, predict.foreground(p, 0, 6000)).own_s
    assert remote.pushed_past == pytest.approx(predict.pushed_past(p, own_s)) and remote.pushed_past > 0
