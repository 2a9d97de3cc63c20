"""The sender's pool of export buffers: bounded in bytes, never lending memory that is still
lent or still read, and settling every lease exactly once whatever ends it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fake_clock import FakeClock
from transport.export_pool import MIN_POOLED_BYTES, NO_LEASE, ExportPool, SinkLender, size_class
from workers.engine.kv_cache import copy_from_blocks

MIB = 1 << 20


@given(st.integers(1, 1 << 34))
def test_size_class_fits_and_wastes_at_most_an_eighth(nbytes):
    size = size_class(nbytes)
    assert nbytes <= size <= nbytes + nbytes // 8
    assert size_class(size) == size


def test_small_layers_are_not_pooled():
    pool = ExportPool()
    assert pool.lend(MIN_POOLED_BYTES - 1) is None
    assert pool.stats()["bytes_owned"] == 0


def test_a_released_buffer_is_lent_again():
    pool = ExportPool()
    first = pool.lend(3 * MIB)
    assert first.buffer.numel() == 3 * MIB and first.buffer.is_contiguous()
    first.release()
    second = pool.lend(3 * MIB - 4096)  # a slightly shorter prompt fits the same buffer
    assert second.storage.data_ptr() == first.storage.data_ptr()
    assert pool.stats()["num_reused"] == 1 and pool.stats()["num_allocated"] == 1
    pool.check_integrity()


def test_a_buffer_comes_back_only_once_its_reader_is_done():
    pool = ExportPool()
    lease = pool.lend(2 * MIB)
    done = [False]
    lease.release_when(lambda: done[0])
    other = pool.lend(2 * MIB)
    assert other.storage.data_ptr() != lease.storage.data_ptr()
    assert pool.stats()["num_draining"] == 1
    done[0] = True
    other.release()
    assert pool.stats() | {"num_free": 2, "num_lent": 0, "num_draining": 0} == pool.stats()


def test_the_pool_stays_within_a_few_largest_layers_and_falls_back_past_them():
    pool = ExportPool(pool_layers=4)
    leases = [pool.lend(4 * MIB) for _ in range(4)]
    assert all(lease is not None for lease in leases)
    assert pool.lend(4 * MIB) is None  # all in flight: the caller allocates a fresh tensor
    assert pool.stats()["num_fallbacks"] == 1
    assert pool.stats()["bytes_owned"] == pool.max_bytes == 16 * MIB
    for lease in leases:
        lease.release()
    pool.check_integrity()


def test_free_buffers_make_room_for_a_larger_layer():
    pool = ExportPool(pool_layers=2)
    small = [pool.lend(MIB) for _ in range(2)]
    for lease in small:
        lease.release()
    big = pool.lend(8 * MIB)  # a free 1 MiB buffer would not fit: drop it, allocate
    assert big is not None and pool.stats()["bytes_owned"] <= pool.max_bytes
    pool.check_integrity()


def test_a_big_free_buffer_is_not_wasted_on_a_small_layer():
    pool = ExportPool()
    pool.lend(16 * MIB).release()
    small = pool.lend(MIB)
    assert small.storage.numel() < 2 * MIB


def test_a_discarded_buffer_is_forgotten_and_every_lease_settles_once():
    pool = ExportPool()
    lease = pool.lend(2 * MIB)
    lease.discard()
    lease.release()  # too late: already settled
    assert pool.stats()["bytes_owned"] == 0
    again = pool.lend(2 * MIB)
    again.release_when(lambda: False)
    again.discard()  # no-op: the pool still waits for the reader
    assert pool.stats()["num_draining"] == 1
    NO_LEASE.release()
    NO_LEASE.discard()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lend", "release", "release_when", "discard", "finish"]),
                          st.integers(1, 12), st.integers(0, 50)), max_size=40))
def test_no_memory_is_lent_while_still_in_use(ops):
    """Whatever the order of lends and settlements, a buffer handed out is never one that
    is lent or still being read: each holder's bytes stay as it wrote them."""
    pool = ExportPool(pool_layers=3)
    held: list[tuple[object, int, list[bool] | None]] = []  # (lease, mark, reader still busy)
    for step, (op, mib, pick) in enumerate(ops):
        if op == "lend":
            lease = pool.lend(mib * MIB // 2)
            if lease is not None:
                lease.buffer.fill_(step % 251)
                held.append((lease, step % 251, None))
        elif held and op == "finish":
            busy = held[pick % len(held)][2]
            if busy is not None:
                busy[0] = False
        elif held:
            lease, mark, busy = held[pick % len(held)]
            if busy is None:
                if op == "release":
                    lease.release()
                    held.remove((lease, mark, busy))
                elif op == "discard":
                    lease.discard()
                    held.remove((lease, mark, busy))
                else:
                    flag = [True]
                    lease.release_when(lambda f=flag: not f[0])
                    held[held.index((lease, mark, busy))] = (lease, mark, flag)
        held = [h for h in held if h[2] is None or h[2][0]]  # a finished reader let go
        for lease, mark, _ in held:
            assert bool((lease.buffer == mark).all()), "a buffer was lent while in use"
        pool.check_integrity()


def test_the_lender_pairs_the_layer_with_its_buffer():
    lender = SinkLender(ExportPool())
    layer = torch.randn(2, 64, 16, 4, 128)  # 64 KiB per block (K and V): 1.6 MiB exported
    block_ids = [3, 4, 5, 9, 10] + list(range(20, 40))
    out = lender.lend(layer[:, block_ids].numel() * 4)
    kv = copy_from_blocks(layer, block_ids, out=out)
    assert kv.data_ptr() == out.data_ptr()
    assert torch.equal(kv, layer[:, block_ids])
    assert lender.claim(kv) is not NO_LEASE
    lender.lend(out.numel())
    assert lender.claim(torch.zeros(3)) is NO_LEASE  # exported elsewhere: given back at once
    lender.lend(out.numel())
    lender.drop_unclaimed()  # the export failed before `on_layer`
    assert lender._pool.stats()["num_lent"] == 1  # only the first, claimed one


def test_an_export_buffer_of_the_wrong_size_is_refused():
    layer = torch.randn(2, 8, 4, 2, 8)
    with pytest.raises(ValueError):
        copy_from_blocks(layer, [0, 1], out=torch.empty(2 * 2 * 4 * 2 * 8 * 4 + 4, dtype=torch.uint8))
    with pytest.raises(ValueError):
        copy_from_blocks(layer, [0, 1], out=torch.empty(2 * 2 * 4 * 2 * 8, dtype=torch.float32))


def test_a_buffer_free_past_the_idle_period_is_dropped_on_the_next_lend():
    clock = FakeClock()
    pool = ExportPool(idle_s=30, clock=clock)
    pool.lend(4 * MIB).release()
    clock.now += 30  # exactly the idle period: still kept
    kept = pool.lend(MIB)  # too small for the free 4 MiB buffer, so it stays free
    assert pool.stats()["bytes_owned"] == 4 * MIB + MIB
    clock.now += 0.5
    again = pool.lend(MIB)
    assert pool.stats()["bytes_owned"] == 2 * MIB  # the 4 MiB buffer went
    assert pool.stats()["num_free"] == 0 and pool.stats()["num_reused"] == 0
    kept.release()
    again.release()
    pool.check_integrity()


def test_a_buffer_free_past_the_idle_period_is_dropped_on_the_next_settle():
    clock = FakeClock()
    pool = ExportPool(idle_s=30, clock=clock)
    idle, busy = pool.lend(8 * MIB), pool.lend(2 * MIB)
    idle.release()
    clock.now += 31
    busy.release()  # settling trims: only the buffer freed just now is left
    stats = pool.stats()
    assert stats["num_free"] == 1 and stats["bytes_owned"] == 2 * MIB
    pool.check_integrity()


def test_a_lent_or_draining_buffer_is_never_dropped_however_old():
    clock = FakeClock()
    pool = ExportPool(idle_s=30, clock=clock)
    lent, draining = pool.lend(2 * MIB), pool.lend(3 * MIB)
    lent.buffer.fill_(7)
    reading = [True]
    draining.release_when(lambda: not reading[0])
    clock.now += 3600
    pool.lend(MIB).release()
    assert pool.stats()["bytes_owned"] == 2 * MIB + 3 * MIB + MIB
    assert bool((lent.buffer == 7).all())
    reading[0] = False  # the reader lets go an hour on: free from now, not from the lend
    pool.lend(MIB).release()
    assert pool.stats()["num_free"] == 2 and pool.stats()["bytes_owned"] == 6 * MIB
    clock.now += 31
    lent.release()  # the draining buffer, free for 31 s, goes; the one released now stays
    assert pool.stats()["bytes_owned"] == 2 * MIB
    pool.check_integrity()


def test_a_buffer_reused_within_the_idle_period_stays():
    clock = FakeClock()
    pool = ExportPool(idle_s=30, clock=clock)
    first = pool.lend(4 * MIB)
    for _ in range(5):  # a prompt every 20 s: never free for 30 s
        first.release()
        clock.now += 20
        lease = pool.lend(4 * MIB)
        assert lease.storage.data_ptr() == first.storage.data_ptr()
        first = lease
    assert pool.stats()["num_allocated"] == 1 and pool.stats()["num_reused"] == 5
    first.release()
    pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lend", "release", "discard", "wait"]),
                          st.integers(1, 8), st.integers(0, 40)), max_size=40))
def test_owned_bytes_stay_exact_as_buffers_expire(ops):
    """Whatever the order of lends (pooled or too small), settlements and waits: the free
    bytes the pool owns come only from buffers freed within the idle period before its last
    lend or settle, the bound holds, and once the pool has sat idle only what is lent is
    owned."""
    clock = FakeClock()
    pool = ExportPool(pool_layers=3, idle_s=30, clock=clock)
    held = []  # lent leases
    freed = []  # (freed at, bytes) of every release; a superset of what the pool keeps free
    trimmed_at = clock.now  # every lend and settle trims
    for op, mib, pick in ops:
        if op == "wait":
            clock.now += pick
        elif op == "lend":
            trimmed_at = clock.now
            lease = pool.lend(mib * MIB // 2)
            if lease is not None:
                held.append(lease)
        elif held:
            trimmed_at = clock.now
            lease = held.pop(pick % len(held))
            if op == "release":
                lease.release()
                freed.append((clock.now, lease.storage.numel()))
            else:
                lease.discard()
        free_bytes = pool.stats()["bytes_owned"] - sum(lease.storage.numel() for lease in held)
        assert 0 <= free_bytes <= sum(n for t, n in freed if trimmed_at - t <= 30)
        assert pool.stats()["num_lent"] == len(held)
        pool.check_integrity()
    clock.now += 31
    lent_bytes = sum(lease.storage.numel() for lease in held)
    spare = pool.lend(MIB)  # a lend after the idle period first trims every free buffer
    if spare is not None:  # None: lent buffers fill the bound
        spare.discard()
    assert pool.stats()["bytes_owned"] == lent_bytes and pool.stats()["num_free"] == 0
    for lease in held:
        lease.release()
    clock.now += 31
    pool.lend(MIB).release()  # a lend trims; its own buffer, just freed, stays
    assert pool.stats()["bytes_owned"] == MIB


def test_a_lend_too_small_to_pool_still_trims():
    clock = FakeClock()
    pool = ExportPool(idle_s=30, clock=clock)
    pool.lend(16 * MIB).release()  # one long prompt, then only short ones
    clock.now += 31
    assert pool.lend(MIN_POOLED_BYTES - 1) is None
    assert pool.stats()["bytes_owned"] == 0 and pool.stats()["num_fallbacks"] == 0
