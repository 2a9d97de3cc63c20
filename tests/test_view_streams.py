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


def test_streams_the_heartbeat_has_not_counted_yet_have_what_this_routers_own_have_left():
    """A heartbeat that counted one stream 4 tokens from its end, then three of this
    router's requests of 32 tokens got their first tokens there: the replica has at least
    three streams (the heartbeat's may be one of them), the two it has not counted have
    31 tokens left, and on average they have (4 + 2 x 31) / 3, not 4 (nor, with no stream
    in the heartbeat, the one token the predictions then take)."""
    from cluster.config import SLO, WorkloadProfile
    from router.placement import PolicyInputs, place

    view = ClusterView(16, 8)
    view.update([ReplicaInfo("d1", "decode", stats={"num_decoding": 1, "decode_tokens_remaining": 4,
                                                    "decode_context_tokens": 100})])
    d = view.replicas["d1"]
    assert view.load_of(d, now=1.0).stream_tokens_left == 4.0
    for _ in range(3):
        p = place(view, [1] * 40, 32, WorkloadProfile(mode="local"), None, offload_to_prefill=False,
                  inputs=PolicyInputs(slo=SLO(ttft_ms=1000, tpot_ms=50), now=1.0))
        view.begin(p)
        view.prefill_done(p, now=1.1, num_tokens=1)
    load = view.load_of(d, now=1.2)
    assert load.num_streams == 3
    assert load.stream_tokens_left == (4 + 2 * 31) / 3
    view.update([ReplicaInfo("d1", "decode", stats={"num_decoding": 4, "decode_tokens_remaining": 100,
                                                    "decode_context_tokens": 400})])
    assert view.load_of(view.replicas["d1"], now=1.3).stream_tokens_left == 25.0  # the heartbeat caught up
