"""A prefill replica that decodes too: under `auto` a local request may run whole on the
prefill replica beside the requests already run whole there, priced like a local
prefill on a decode replica (its streams, their objectives, those joining them); the
fixed rules keep offering it only while the prefill replica is idle."""

from __future__ import annotations

import pytest

from cluster.config import SLO, WorkloadProfile
from router import predict, replica_steps
from router.auto_policy import score
from router.candidate import RequestShape
from router.cluster_view import ClusterView, ReplicaInfo
from router.placement import PolicyInputs, place
from router.routing import decide
from tests.test_auto_policy import COEFFS, ctx, replica


def _streams(n: int, context: int = 300, left: float = 30.0) -> dict:
    return {"num_streams": n, "stream_context": n * context, "stream_tokens_left": left}


def test_the_whole_candidate_prices_the_streams_already_on_the_prefill_replica():
    req = RequestShape(prompt_len=100, max_tokens=32)
    idle = predict.whole(req, replica("p1", "prefill"), 0)
    busy = predict.whole(req, replica("p1", "prefill", **_streams(4)), 0)
    assert (idle.num_streams, idle.prediction.streams_tpot_s) == (0, 0.0)
    assert busy.num_streams == 4 and busy.prediction.streams_tpot_s > replica_steps.decode_step_s(
        replica("p1", "prefill", **_streams(4)))  # its prompt's step stalls them once
    assert busy.prediction.tpot_s > idle.prediction.tpot_s  # it decodes beside them
    assert busy.decode_replica == busy.prefill_replica == "p1" and busy.route == "local"


def test_auto_runs_a_request_whole_where_fewer_streams_decode():
    """Eight streams on the decode replica against an 8 ms objective: with this request
    a decode step there takes 9.5 ms, so it misses however its prompt runs there. The
    prefill replica decodes two; beside them (6.5 ms a step) it meets its objective."""
    slo = SLO(ttft_ms=2000, tpot_ms=8)
    decode = replica("d1", **_streams(8))
    light = replica("p1", "prefill", **_streams(2))
    decision = decide(ctx(prompt_len=100, slo=slo, decode=decode, prefills=(light,), whole=light))
    assert decision.candidate.kind == "whole" and decision.route == "local"
    crowded = replica("p1", "prefill", **_streams(12))  # busier than the decode replica: not there
    assert decide(ctx(prompt_len=100, slo=slo, decode=decode, prefills=(crowded,),
                      whole=crowded)).candidate.kind != "whole"


def test_the_streams_beside_a_whole_request_are_held_to_their_own_allowances():
    """The same candidate costs more where the prefill replica's streams can afford less:
    their objective comes from their allowances there, not the decode replica's."""
    slo = SLO(ttft_ms=2000, tpot_ms=50)
    tight_s = replica_steps.decode_step_s(replica("p1", "prefill", **_streams(4))) * 1.2

    def loss(there_s: float, on_decode_s: float) -> float:
        decode = replica("d1", **_streams(3), stream_allowances=(on_decode_s,) * 3)
        p1 = replica("p1", "prefill", **_streams(3), stream_allowances=(there_s,) * 3)
        context = ctx(prompt_len=600, slo=slo, decode=decode, prefills=(p1,), whole=p1)
        candidate = predict.whole(context.shape, p1, 0)
        return score(context, candidate, candidate.prediction).loss

    assert loss(0.5, tight_s) == pytest.approx(0.0)
    assert loss(tight_s, 0.5) > 0.1


def _view_with_a_whole_request_on_p1() -> ClusterView:
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([ReplicaInfo("d1", "decode", healthy=True, stats={}),
                 ReplicaInfo("p1", "prefill", healthy=True, stats={})])
    for seed in (1, 2):  # d1 decodes two requests
        view.begin(place(view, [seed] * 40, 16, WorkloadProfile(mode="local"), None, offload_to_prefill=False))
    first = place(view, [3] * 40, 16, WorkloadProfile(mode="local"), None)
    assert first.deployment == "prefill"  # p1 was idle: the fixed rule runs it whole there
    view.begin(first)
    view.prefill_done(first, now=0.5, num_tokens=1)  # its prompt is computed: it decodes there
    return view


@pytest.mark.parametrize(("mode", "offered"), [("auto", True), ("threshold", False), ("local", False)])
def test_only_auto_is_offered_a_prefill_replica_that_already_decodes(mode, offered):
    view = _view_with_a_whole_request_on_p1()
    placement = place(view, [4] * 40, 16, WorkloadProfile(mode=mode), None, inputs=PolicyInputs(now=1.0),
                      keep_context=True)
    assert (placement.context.whole is not None) == offered
    if offered:
        assert placement.context.whole.replica_id == "p1" and placement.context.whole.num_streams == 1


def test_a_prefill_replica_that_computes_a_prompt_is_not_offered():
    """A prompt this router sent there still waits for its first token, or the replica's
    heartbeat reports one waiting (another router's): a request run whole there would
    queue behind it and stall beside its chunks."""
    view = _view_with_a_whole_request_on_p1()
    remote = place(view, [5] * 600, 16, WorkloadProfile(mode="disagg"), None)
    view.begin(remote)
    assert place(view, [6] * 40, 16, WorkloadProfile(mode="auto"), None, inputs=PolicyInputs(now=1.0),
                 keep_context=True).context.whole is None
    view.prefill_done(remote, now=1.2, num_tokens=1)
    assert place(view, [6] * 40, 16, WorkloadProfile(mode="auto"), None, inputs=PolicyInputs(now=1.3),
                 keep_context=True).context.whole is not None
    view.update([ReplicaInfo("d1", "decode", healthy=True, stats={}),
                 ReplicaInfo("p1", "prefill", healthy=True, stats={"prompt_tokens_waiting": 900})])
    assert place(view, [6] * 40, 16, WorkloadProfile(mode="auto"), None, inputs=PolicyInputs(now=1.4),
                 keep_context=True).context.whole is None


def test_a_full_prefill_replica_is_not_offered():
    view = ClusterView(block_size=16, max_num_seqs=1)
    view.update([ReplicaInfo("d1", "decode", healthy=True, stats={}),
                 ReplicaInfo("p1", "prefill", healthy=True, stats={})])
    view.begin(place(view, [1] * 40, 16, WorkloadProfile(mode="local"), None, offload_to_prefill=False))
    whole = place(view, [2] * 40, 16, WorkloadProfile(mode="local"), None)  # whole on p1: its one seat
    view.begin(whole)
    view.prefill_done(whole, now=0.5, num_tokens=1)
    placement = place(view, [3] * 40, 16, WorkloadProfile(mode="auto"), None, inputs=PolicyInputs(now=1.0),
                      keep_context=True)
    assert placement.context.whole is None


def test_coefficients_behind_the_table():
    """The arithmetic the tests above lean on."""
    assert replica_steps.decode_step_s(replica("d1", **_streams(8)), extra_seqs=1) == pytest.approx(0.0095)
    assert COEFFS.decode_seq_s == 5e-4


def test_a_prefill_replica_computing_only_prompts_run_whole_there_is_offered():
    """A short prompt that took the idle prefill replica first leaves it computing only a
    prompt that decodes there too: the next one may still run whole beside it (it was
    left to queue behind a long prompt on the decode replica instead)."""
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([ReplicaInfo("d1", "decode", healthy=True, stats={}),
                 ReplicaInfo("p1", "prefill", healthy=True, stats={})])
    view.begin(place(view, [1] * 40, 16, WorkloadProfile(mode="local"), None, offload_to_prefill=False))
    first = place(view, [3] * 40, 16, WorkloadProfile(mode="local"), None)
    assert first.deployment == "prefill"  # p1 was idle: run whole there, its prompt not computed yet
    view.begin(first)
    assert place(view, [4] * 40, 16, WorkloadProfile(mode="auto"), None, inputs=PolicyInputs(now=0.01),
                 keep_context=True).context.whole is not None
