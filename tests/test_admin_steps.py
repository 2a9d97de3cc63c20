"""`GET /admin/steps` behind the HTTP layer: the router asks every replica in its view for
its recent records over real worker streams (ZeroMQ, sealed); a replica that cannot answer
is listed with an error, never failing the whole answer."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from router.admin import collect_steps, parse_steps_query
from router.cluster_view import ClusterView, ReplicaInfo
from router.errors import APIError
from transport.transfer_record import TransferRecord
from workers.engine.step_cost import StepRecord
from workers.engine_worker import _recent
from workers.protocol import StepsReply, StepsRequest
from workers.stream.client import WorkerStreams
from workers.stream.server import StreamServer
from workers.stream.wire import StreamCodec

KEY = "steps-test-key-0123456789abcdef"
STEPS = [StepRecord(start_time=100.0 + i, step_time_s=0.01, num_prefill_tokens=8, num_decode_seqs=1,
                    num_context_tokens=20, num_running=2, num_waiting=0, num_prefill_seqs=1,
                    prefill_attention_work=8 * 19) for i in range(5)]
TRANSFERS = [TransferRecord("t1", 4096, 4, "tcp", 101.5, 0.02, 0.005)]


def test_recent_keeps_the_newest_since_oldest_first():
    assert [r["start_time"] for r in _recent(STEPS, 101.0, 2)] == [103.0, 104.0]
    assert [r["start_time"] for r in _recent(STEPS, 0.0, 1000)] == [100.0 + i for i in range(5)]
    assert _recent(STEPS, 0.0, 0) == [] and _recent((), 0.0, 10) == []


def test_recent_keeps_a_record_by_when_it_ended():
    """A record is kept when its step or transfer ends: a transfer that ran past a poll
    comes in the next one, asked from that poll on (one over a slow link takes seconds)."""
    slow = TransferRecord("t2", 4096, 4, "shm", 200.0, 5.7, 5.5)
    quick = TransferRecord("t3", 4096, 4, "shm", 203.0, 0.02, 0.005)
    records = [quick, slow]  # as the sender appends them: in the order they end
    assert [r["transfer_id"] for r in _recent(records, 204.0, 10)] == ["t2"]
    assert [r["transfer_id"] for r in _recent(records, 203.0, 10)] == ["t3", "t2"]
    assert _recent(records, 206.0, 10) == []
    long_step = dataclasses.replace(STEPS[0], start_time=300.0, step_time_s=1.6)
    assert [r["start_time"] for r in _recent([long_step], 301.0, 10)] == [300.0]


def test_query_parameters():
    assert parse_steps_query({}) == StepsRequest(0.0, 1000)
    assert parse_steps_query({"since": "1700000000.5", "limit": "7"}) == StepsRequest(1700000000.5, 7)
    for bad in ({"since": "yesterday"}, {"since": "nan"}, {"limit": "-1"}, {"limit": "2.5"}):
        with pytest.raises(APIError) as err:
            parse_steps_query(bad)
        assert err.value.status == 400


def test_every_replica_answers_or_is_listed_with_an_error():
    async def steps(req: StepsRequest):
        yield StepsReply("prefill", _recent(STEPS, req.since, req.limit), _recent(TRANSFERS, req.since, req.limit))

    async def silent(req: StepsRequest):
        await asyncio.sleep(30)
        yield StepsReply("decode")

    async def generate(req):
        yield None

    async def main():
        servers = {name: StreamServer(handlers, StreamCodec(KEY), "127.0.0.1").start()
                   for name, handlers in (("p0", {"steps": steps}), ("d0", {"steps": silent}),
                                          ("d1", {"generate": generate}))}
        view = ClusterView(16, 8)
        view.update([ReplicaInfo(name, "prefill" if name == "p0" else "decode",
                                 extra={"stream_address": s.address}) for name, s in servers.items()]
                    + [ReplicaInfo("d2", "decode", node_id="node-2")])
        streams = WorkerStreams(StreamCodec(KEY))
        try:
            got = (await collect_steps(streams, view, StepsRequest(101.0, 3), timeout_s=1.0))["replicas"]
            assert set(got) == {"p0", "d0", "d1", "d2"}
            assert got["p0"] == {"role": "prefill", "steps": [dataclasses.asdict(r) for r in STEPS[2:]],
                                 "transfers": [dataclasses.asdict(TRANSFERS[0])]}
            for name in ("d0", "d1", "d2"):  # silent, no such method, no stream address
                assert got[name]["role"] == "decode" and got[name]["error"] and not got[name]["steps"]
            assert "no method" in got["d1"]["error"]
            assert got["d2"]["node_id"] == "node-2" and "node_id" not in got["p0"]  # where a heartbeat named it
            assert (await collect_steps(None, view, StepsRequest()))["replicas"]["p0"]["error"]
        finally:
            streams.close()
            for server in servers.values():
                server.close()

    asyncio.run(main())
