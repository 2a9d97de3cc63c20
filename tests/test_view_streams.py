"""The view's streams on a replica are this router's requests past their first token
there: never the remote prefills a prefill replica computes for another replica."""

from __future__ import annotations

from router.cluster_view import ClusterView, ReplicaInfo
from router.placement import Placement
from router.policy import RouteDecision


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
    p1, d1 = view.replicas["p1"], view.replicas["d1"]
    remotes = [_remote(i) for i in range(3)]
    for r in remotes:
        view.begin(r)
    assert view.num_streams(p1) == 0 and view.load(p1) == 3  # busy, but nothing decodes there
    whole = _whole()
    view.begin(whole)
    assert view.num_streams(p1) == 0  # its prompt first
    view.prefill_done(whole)
    assert view.num_streams(p1) == 1  # now it decodes there
    view.prefill_done(remotes[0])  # done: its KV went to d1, where it decodes
    assert view.num_streams(d1) == 1
    view.end(remotes[1])  # failed before its first token
    assert view.num_streams(p1) == 1 and view.load(p1) == 2
    for placement in (remotes[0], whole, remotes[2]):
        view.end(placement)
    assert view.num_streams(p1) == view.load(p1) == view.num_streams(d1) == 0 and not view.prefilling
