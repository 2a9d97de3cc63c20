"""Admission and tenants without Ray: token buckets, per-tenant concurrency, the bounded
priority queue (interactive before batch), timeouts, and the keys-file format."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import Admission, TokenBucket, hold_until_sent
from router.errors import APIError
from router.tenants import Quota, Tenants
from tests.fake_clock import FakeClock

KEYS = {
    "keys": {
        "sk-alpha": {"tenant": "alpha", "workload": "interactive"},
        "sk-batch": {"tenant": "nightly", "workload": "batch"},
        "sk-solo": {"tenant": "solo", "rate": 2, "concurrency": 1, "priority": "batch"},
    },
    "tenants": {"alpha": {"rate": 10, "burst": 20, "concurrency": 4},
                "nightly": {"concurrency": 2, "priority": "batch"}},
    "default": {"concurrency": 3},
}


def test_keys_file_quotas_and_defaults():
    t = Tenants.parse(KEYS)
    assert t.quota("alpha") == Quota(10, 20, 4, "interactive")
    assert t.quota("nightly") == Quota(None, None, 2, "batch")
    assert t.quota("solo") == Quota(2, 2, 1, "batch")  # burst defaults to ceil(rate)
    assert t.quota("stranger") == Quota(None, None, 3, "interactive")
    halves = t.per_replica(2)
    assert halves.quota("alpha") == Quota(5, 10, 2, "interactive")
    assert halves.quota("solo").concurrency == 1  # never below one


@pytest.mark.parametrize("bad, where", [
    ({"keys": {"sk-x": {"tenant": "t", "rte": 1}}}, "<key of tenant t>.rte"),
    ({"tenants": {"a": {"rate": -1}}}, "tenants.a.rate"),
    ({"tenants": {"a": {"priority": "urgent"}}}, "tenants.a.priority"),
    ({"quota": {}}, "quota"),
])
def test_keys_file_errors_name_the_field_never_the_key(bad, where):
    with pytest.raises(ValueError) as e:
        Tenants.parse(bad, "keys.yaml")
    assert where in str(e.value) and "sk-x" not in str(e.value)


def test_token_bucket_refills_at_rate():
    b = TokenBucket(rate=2.0, burst=2, now=0.0)
    assert b.take(0.0) == 0 and b.take(0.0) == 0
    assert b.take(0.0) == pytest.approx(0.5)
    assert b.take(0.5) == 0  # one token back after 1/rate


def run(coro):
    return asyncio.run(coro)


def test_rate_limit_is_429_with_retry_after():
    clock = FakeClock(100.0)

    async def go():
        adm = Admission(Tenants.parse(KEYS), 100, 10, 5.0, clock)
        for _ in range(2):
            (await adm.acquire("solo")).release()
        with pytest.raises(APIError) as e:
            await adm.acquire("solo")
        assert e.value.status == 429 and int(e.value.headers["retry-after"]) >= 1
        assert "rate" in e.value.message
        clock.now += 0.6
        (await adm.acquire("solo")).release()
        assert adm.state() == {"num_running": 0, "num_queued": 0, "per_tenant": {}}

    run(go())


def test_tenant_concurrency_quota():
    async def go():
        adm = Admission(Tenants.parse(KEYS), 100, 10, 5.0)
        held = [await adm.acquire("nightly") for _ in range(2)]
        with pytest.raises(APIError) as e:
            await adm.acquire("nightly")
        assert e.value.status == 429 and e.value.code == "concurrency_limit_exceeded"
        (await adm.acquire("alpha")).release()  # other tenants are not affected
        held[0].release()
        held[0].release()  # idempotent
        (await adm.acquire("nightly")).release()
        held[1].release()
        assert adm.state()["per_tenant"] == {}

    run(go())


def test_interactive_before_batch_and_bounded_queue():
    async def go():
        adm = Admission(Tenants.parse(KEYS), 1, 3, 5.0)
        running = await adm.acquire("alpha")
        order: list[str] = []

        async def queued(tenant):
            ticket = await adm.acquire(tenant)
            order.append(tenant)
            await asyncio.sleep(0)
            ticket.release()

        tasks = [asyncio.create_task(queued(t)) for t in ("nightly", "solo", "alpha")]
        await asyncio.sleep(0.01)
        assert adm.num_queued == 3
        with pytest.raises(APIError) as e:  # the queue holds 3
            await adm.acquire("stranger")
        assert e.value.status == 429 and e.value.headers["retry-after"] == "1"
        running.release()
        await asyncio.gather(*tasks)
        assert order == ["alpha", "nightly", "solo"]  # interactive first, then FIFO
        assert adm.state() == {"num_running": 0, "num_queued": 0, "per_tenant": {}}

    run(go())


def test_queue_timeout_and_client_leaving_while_queued():
    async def go():
        adm = Admission(Tenants.unlimited(), 1, 5, 0.2)
        running = await adm.acquire(None)
        with pytest.raises(APIError) as e:
            await adm.acquire(None)
        assert e.value.status == 429 and e.value.code == "server_overloaded"
        leaver = asyncio.create_task(adm.acquire(None))
        await asyncio.sleep(0.01)
        leaver.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaver
        running.release()
        assert adm.state() == {"num_running": 0, "num_queued": 0, "per_tenant": {}}

    run(go())


def _sample(m, name: str, **labels) -> float:
    """One series of a RouterMetrics registry (0.0 when it has none yet)."""
    from router.metrics import snapshot

    return sum(v for f in snapshot(m.registry) for n, got, v in f["samples"]
               if n == name and labels.items() <= got.items())


def test_every_429_is_counted_by_tenant_and_code():
    from router.metrics import RouterMetrics

    m = RouterMetrics("tiny")

    async def go():
        adm = Admission(Tenants.parse(KEYS), 2, 0, 5.0, FakeClock(100.0), observer=m)
        for _ in range(2):
            (await adm.acquire("solo")).release()
        held = [await adm.acquire("nightly") for _ in range(2)]  # its quota, and every slot
        for tenant in ("solo", "nightly", None):  # over its rate, its concurrency, no slot
            with pytest.raises(APIError):
                await adm.acquire(tenant)
        for ticket in held:
            ticket.release()

    run(go())
    rejected = "pdc_requests_rejected_total"
    assert _sample(m, rejected, tenant="solo", code="rate_limit_exceeded") == 1
    assert _sample(m, rejected, tenant="nightly", code="concurrency_limit_exceeded") == 1
    assert _sample(m, rejected, tenant="anonymous", code="server_overloaded") == 1
    assert _sample(m, rejected, model="tiny") == 3


def test_admission_wait_is_observed_for_every_admitted_request():
    from router.metrics import RouterMetrics

    m = RouterMetrics("tiny")

    async def go():
        adm = Admission(Tenants.unlimited(), 1, 1, 5.0, observer=m)
        running = await adm.acquire(None)
        waiter = asyncio.create_task(adm.acquire(None))
        await asyncio.sleep(0.05)
        running.release()
        (await waiter).release()

    run(go())
    queue = "pdc_request_queue_seconds"
    assert _sample(m, f"{queue}_count", stage="admission") == 2
    assert _sample(m, f"{queue}_bucket", stage="admission", le="0.001") == 1  # the first did not wait
    assert 0.04 <= _sample(m, f"{queue}_sum", stage="admission") < 1.0


def test_stream_holds_its_ticket_until_the_end():
    from fastapi.responses import JSONResponse, StreamingResponse

    async def go():
        adm = Admission(Tenants.unlimited(), 4, 4, 1.0)
        plain = hold_until_sent(JSONResponse({}), await adm.acquire(None))
        assert plain.status_code == 200 and adm.num_running == 0

        async def body():
            yield b"a"
            yield b"b"

        streamed = hold_until_sent(StreamingResponse(body()), await adm.acquire(None))
        assert adm.num_running == 1
        assert [c async for c in streamed.body_iterator] == [b"a", b"b"]
        assert adm.num_running == 0
        never = hold_until_sent(StreamingResponse(body()), await adm.acquire(None))
        assert adm.num_running == 1
        del never  # a response that was never sent (client gone before the first byte)
        import gc

        gc.collect()
        assert adm.num_running == 0

    run(go())


def test_overdue_heartbeats_are_not_a_dead_pool():
    """On a saturated machine every heartbeat can be late at once: the router still tries
    replicas whose last heartbeat said healthy (503 only when none is left)."""
    from cluster.config import WorkloadProfile
    from router.cluster_view import ClusterView, ReplicaInfo
    from router.placement import place

    auto = WorkloadProfile(mode="auto", min_remote_prefill_tokens=32, max_prefill_queue=4)
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([ReplicaInfo("d1", "decode", healthy=False, stats={"healthy": True}),
                 ReplicaInfo("p1", "prefill", healthy=False, stats={"healthy": True})])
    placement = place(view, list(range(100)), 4, auto, None)
    assert (placement.target_replica, placement.decision.route) == ("d1", "local")
    view.excluded.add("d1")  # its call failed: dispatch excludes it
    with pytest.raises(APIError) as e:
        place(view, list(range(100)), 4, auto, None)
    assert e.value.status == 503
    view.update([ReplicaInfo("d1", "decode", healthy=False, stats={"healthy": False})])  # engine dead
    with pytest.raises(APIError):
        place(view, [1, 2, 3], 4, auto, None)
