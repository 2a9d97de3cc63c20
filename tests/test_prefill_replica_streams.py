"""A prefill replica that runs requests whole has streams of its own: the view counts
them (and not the remote prefills it computes for others), and a remote prefill there is
priced beside them."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.config import SLO
from router import predict
from router.auto_policy import beside, candidates, corrected, score
from router.cluster_view import ClusterView, ReplicaInfo
from router.corrections import EMPTY
from router.placement import Placement
from router.policy import RouteDecision
from router.routing import decide
from tests.test_auto_policy import BUSY_STREAMS, ctx, replica


def _view() -> ClusterView:
    view = ClusterView(16, 8)
    view.update([ReplicaInfo("d1", "decode"), ReplicaInfo("p1", "prefill")])
    return view


def _remote(i: int) -> Placement:
    return Placement("decode", "d1", "p1", RouteDecision("disagg", "slo-disagg"), 0, prefill_on="p1",
                     prefill_tokens=500, placed_at=float(i))


def _whole() -> Placement:
    return Placement("prefill", "p1", None, RouteDecision("local", "slo-local"), 0, prefill_on="p1",
                     prefill_tokens=100, placed_at=0.0)


def test_a_remote_prefill_is_not_a_stream_of_the_replica_computing_it():
    view = _view()
    p1 = view.replicas["p1"]
    remotes = [_remote(i) for i in range(3)]
    for r in remotes:
        view.begin(r)
    assert view.num_streams(p1) == 0 and view.load(p1) == 3  # busy, but nothing decodes there
    whole = _whole()
    view.begin(whole)
    assert view.num_streams(p1) == 0  # its prompt first
    view.prefill_done(whole)
    assert view.num_streams(p1) == 1  # now it decodes there
    view.prefill_done(remotes[0])  # done: its KV went to d1
    view.end(remotes[1])  # failed before its first token
    assert view.num_streams(p1) == 1 and view.load(p1) == 2
    view.end(remotes[0])
    view.end(whole)
    view.end(remotes[2])
    assert view.num_streams(p1) == 0 and view.load(p1) == 0 and not view.prefilling
    assert view.num_streams(view.replicas["d1"]) == 0


def test_a_remote_prefill_is_priced_beside_the_streams_its_replica_runs_whole():
    req = predict.RequestShape(1000, 32)
    d = replica("d1")
    idle_p = replica("p1", "prefill")
    busy_p = replica("p1", "prefill", num_streams=2, stream_context=2 * 300, stream_tokens_left=20.0,
                     stream_allowances=(0.030, 0.040))
    quiet, beside_two = predict.remote(req, idle_p, d, 0, 0), predict.remote(req, busy_p, d, 0, 0)
    assert quiet.prefill_streams == 0 and quiet.prediction.prefill_streams_tpot_s == 0.0
    assert beside_two.prefill_streams == 2
    # its 1,000 tokens in two 512-token steps slow the two streams' next gaps
    assert beside_two.prediction.prefill_streams_tpot_s > predict.expected_gap_s(busy_p)
    context = ctx(slo=SLO(ttft_ms=2000, tpot_ms=50), decode=d, prefills=(busy_p,))
    groups = beside(context, beside_two, corrected(beside_two, EMPTY, 0.0), EMPTY, 0.0)
    assert [(g.at_stake, g.objective_s, g.route) for g in groups] == [(2, 0.030, "local")]


def test_the_streams_a_prefill_replica_runs_whole_keep_a_remote_prefill_away():
    """Two streams on the prefill replica can afford 12 ms a token; a 1,000-token remote
    prefill there would take two 57 ms steps of their last ten. Remote meets every SLO
    without them; with them, the prompt prefills where it decodes instead."""
    slo = SLO(ttft_ms=3000, tpot_ms=50)
    d = replica("d1")
    p_whole = dict(num_streams=2, stream_context=600, stream_tokens_left=10.0, stream_allowances=(0.012, 0.012))

    slow_local = dataclasses.replace(d, queue_tokens=1500)  # local waits behind 1,500 tokens
    assert decide(ctx(slo=slo, decode=slow_local, prefills=(replica("p1", "prefill"),))).candidate.kind == "remote"
    context = ctx(slo=slo, decode=slow_local, prefills=(replica("p1", "prefill", **p_whole),))
    remote = next(c for c in candidates(context) if c.kind == "remote")
    scored = score(context, remote, corrected(remote, EMPTY, 0.0))
    assert not scored.meets and scored.loss > 0
    assert decide(context).candidate.kind in {"local", "background"}


@pytest.mark.parametrize("kind", ["local", "background", "whole"])
def test_only_a_remote_prefill_has_streams_on_its_prefill_replica(kind):
    context = ctx(decode=replica("d1", **BUSY_STREAMS), whole=replica("p1", "prefill"))
    by_kind = {c.kind: c for c in candidates(context)}
    assert by_kind[kind].prefill_streams == 0 and by_kind[kind].prediction.prefill_streams_tpot_s == 0.0
