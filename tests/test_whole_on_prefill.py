"""A prefill replica that runs requests whole (prefill and decode): `auto` offers it even
when busy and prices it as `local` there, beside the streams it already runs; a remote
prefill on it is charged for slowing those streams; the fixed rules send a request there
only while it is idle and the decode replica is not."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.config import SLO, WorkloadProfile
from router import predict
from router.auto_policy import candidates, score
from router.cluster_view import ClusterView, ReplicaInfo
from router.placement import PolicyInputs, place
from router.routing import decide
from tests.test_auto_policy import BUSY_STREAMS, ctx, replica

# 8 streams decode in 9 ms a step (5 + 8 x 0.5), 9 of them in 9.5 ms
TIGHT_TPOT = SLO(ttft_ms=2000, tpot_ms=9.2)
ONE_STREAM = {"num_streams": 1, "stream_context": 600, "stream_tokens_left": 40.0}


def test_whole_is_priced_beside_the_streams_the_prefill_replica_already_runs():
    busy_p = replica("p1", "prefill", **ONE_STREAM)
    context = ctx(prompt_len=200, decode=replica("d1", **BUSY_STREAMS), whole=busy_p)
    by_kind = {c.kind: c for c in candidates(context)}
    whole, local = by_kind["whole"], by_kind["local"]
    assert whole.decode_replica == whole.prefill_replica == "p1"
    assert whole.num_streams == 1 and whole.prediction.streams_tpot_s > predict.expected_gap_s(busy_p)
    assert whole.prediction.tpot_s < local.prediction.tpot_s  # one stream beside it, not eight
    idle = {c.kind: c for c in candidates(dataclasses.replace(context, whole=replica("p1", "prefill")))}["whole"]
    assert idle.num_streams == 0 and idle.prediction.streams_tpot_s == 0.0


def test_auto_spreads_streams_to_a_busy_prefill_replica_when_the_decode_replica_is_full():
    """Eight streams on the decode replica at the objective's edge: a ninth there misses
    its TPOT on every route through it; run whole beside the prefill replica's one stream
    it meets."""
    context = ctx(prompt_len=200, slo=TIGHT_TPOT, decode=replica("d1", **BUSY_STREAMS),
                  prefills=(replica("p1", "prefill", **ONE_STREAM),), whole=replica("p1", "prefill", **ONE_STREAM))
    decision = decide(context)
    assert (decision.route, decision.reason, decision.candidate.kind) == ("local", "slo-local", "whole")
    assert not any(a.meets for a in decision.alternatives if a.candidate.kind != "whole")


def test_a_remote_prefill_is_charged_for_the_streams_on_its_prefill_replica():
    """Two prefill replicas: the less loaded one decodes four streams of its own, near
    their end, whose objective its 1,000-token prefill would break; the other has a queue
    but no streams. Remote goes to the other one."""
    # two 58 ms mixed steps among their last ten gaps (7 ms alone): 17 ms a gap
    streams_p = replica("p1", "prefill", num_streams=4, stream_context=2400, stream_tokens_left=10.0)
    queued_p = replica("p2", "prefill", queue_tokens=3000)
    context = ctx(decode=replica("d1", **BUSY_STREAMS), slo=SLO(ttft_ms=2000, tpot_ms=12),
                  prefills=(streams_p, queued_p), prefill_cached_tokens=(0, 0))
    remote = {c.prefill_replica: c for c in candidates(context) if c.kind == "remote"}
    on_p1 = remote["p1"]
    assert on_p1.prefill_streams == 4 and remote["p2"].prefill_streams == 0
    assert on_p1.prediction.prefill_streams_tpot_s > 0.012  # its prefill stalls them past 12 ms
    scored = score(context, on_p1, on_p1.prediction)
    assert not scored.meets and scored.loss > 0
    decision = decide(context)
    assert (decision.route, decision.candidate.prefill_replica) == ("disagg", "p2")


@pytest.mark.parametrize("mode", ["threshold", "local"])
def test_the_fixed_rules_run_a_request_whole_only_on_an_idle_prefill_replica(mode):
    profile = WorkloadProfile(mode=mode, min_remote_prefill_tokens=10_000)
    offered = ctx(prompt_len=200, profile=profile, decode=replica("d1", **BUSY_STREAMS),
                  whole=replica("p1", "prefill", **ONE_STREAM))
    assert decide(offered).candidate.kind == "local"
    idle = dataclasses.replace(offered, whole=replica("p1", "prefill"), whole_idle=True)
    assert decide(idle).candidate.kind == "whole"


def test_placement_offers_a_busy_prefill_replica_with_room_and_runs_the_request_there():
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([ReplicaInfo("d1", "decode", stats={"num_running": 8}), ReplicaInfo("p1", "prefill",
                                                                                    stats={"num_running": 1})])
    inputs = PolicyInputs(slo=TIGHT_TPOT, request_id="r1")
    placed = place(view, [7] * 200, 32, WorkloadProfile(mode="auto"), None, inputs=inputs, keep_context=True)
    assert placed.context.whole is not None and not placed.context.whole_idle
    assert any(a.candidate.kind == "whole" for a in placed.decision.alternatives)
    full = ClusterView(block_size=16, max_num_seqs=8)
    full.update([ReplicaInfo("d1", "decode", stats={"num_running": 2}),
                 ReplicaInfo("p1", "prefill", stats={"num_running": 8})])
    crowded = place(full, [7] * 200, 32, WorkloadProfile(mode="auto"), None, inputs=inputs, keep_context=True)
    assert crowded.context.whole is None  # no sequence slot left there
