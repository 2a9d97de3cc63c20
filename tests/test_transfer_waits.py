"""A transfer still waiting for its acknowledgement prices its link: a prefill replica
reports, per decode peer, how long its computed prompts' KV has waited, and a remote
prefill to that peer is priced with at least that tail, before any record of the slow
transfers exists."""

from __future__ import annotations

import pytest

from cluster.config import SLO
from router import predict
from router.candidate import RequestShape
from router.replica_load import ReplicaLoad, from_stats
from router.routing import decide
from tests.fake_clock import FakeClock
from tests.test_auto_policy import BUSY_STREAMS, ctx, replica
from workers.engine.cost_model import StepCoefficients
from workers.transfer_waits import TransferWaits

MODEL = StepCoefficients(fixed_s=0.01, prefill_token_s=0.001, prefill_attention_s=0.0, decode_seq_s=0.002,
                         decode_context_s=0.0)


def test_the_longest_wait_per_peer_until_acknowledged():
    clock = FakeClock(100.0)
    waits = TransferWaits(clock)
    assert waits.longest() == {}
    waits.computed("t1", "d1:5555")
    clock.now += 0.5
    waits.computed("t2", "d1:5555")
    waits.computed("t3", "d2:5555")
    clock.now += 0.25
    assert waits.longest() == {"d1:5555": 0.75, "d2:5555": 0.25}
    waits.acknowledged("t1")
    waits.acknowledged("t9")  # unknown: nothing happens
    assert waits.longest() == {"d1:5555": 0.25, "d2:5555": 0.25}


def test_the_heartbeat_carries_it_and_bad_entries_are_dropped():
    load = from_stats("p", "prefill", {"transfer_waiting_s": {"d1:5555": 2.5, "d2:5555": "x", "d3:5555": 0}})
    assert load.transfer_waiting == {"d1:5555": 2.5}
    assert from_stats("p", "prefill", {"transfer_waiting_s": [1, 2]}).transfer_waiting == {}


def _replicas(waiting: dict[str, float]) -> tuple[ReplicaLoad, ReplicaLoad]:
    p = ReplicaLoad("p", "prefill", MODEL, kv_bytes_per_token=1000, transfer_waiting=waiting)
    d = ReplicaLoad("d", "decode", MODEL, kv_bytes_per_token=1000, address="d1:5555", num_streams=2,
                    stream_context=200, stream_tokens_left=20.0)
    return p, d


def test_a_remote_prefill_takes_at_least_the_tail_already_waited_on_its_peer():
    req = RequestShape(prompt_len=1000, max_tokens=8)
    fast = predict.remote(req, *_replicas({}), 0, 0).prediction
    slow = predict.remote(req, *_replicas({"d1:5555": 3.0}), 0, 0).prediction
    other = predict.remote(req, *_replicas({"d2:5555": 3.0}), 0, 0).prediction
    assert fast.transfer_s < 0.1
    assert slow.transfer_s == 3.0
    assert slow.ttft_s == pytest.approx(fast.ttft_s + 3.0 - fast.transfer_s)
    assert other == fast  # a wait on another peer's link says nothing of this one's


def test_auto_prefills_beside_the_streams_rather_than_down_a_link_still_waiting():
    """Remote keeps the streams' tight TPOT; with a transfer to their replica waiting 3 s
    unacknowledged, it would miss the TTFT objective, and the prompt prefills beside them."""
    slo = SLO(ttft_ms=2000, tpot_ms=12)
    fast = decide(ctx(decode=replica("d1", **BUSY_STREAMS), slo=slo))
    slow = decide(ctx(decode=replica("d1", **BUSY_STREAMS), slo=slo,
                      prefills=(replica("p1", "prefill", transfer_waiting={"tcp://d1": 3.0}),)))
    assert (fast.route, fast.candidate.kind) == ("disagg", "remote")
    assert (slow.route, slow.reason, slow.candidate.kind) == ("local", "protect-streams", "background")
