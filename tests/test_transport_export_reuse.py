"""Reused export buffers across real transports: a sender process exports many large layers
back to back through the engine's own seam (`export_layer` into the buffer its sink lends)
and every layer lands bit-identical, checksum verified; a buffer is never lent again while
a send may still read it, and none stays lent after a transfer fails or is cancelled."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import socket
import time

import pytest
import torch

from tests.test_transport_backends import KEY, TIMEOUT_S, collect, config, spawn
from transport.address import PeerAddress
from transport.base import TransferError, TransferTimeout
from transport.factory import make_receiver, make_sender
from transport.memory_target import MemoryTarget, make_layout
from workers.engine.attention import KVExport, export_layer
from workers.engine.kv_cache import KVCache

# 64 KiB per block per layer: a 36-48 block prompt exports 2.25-3 MiB layers (pooled sizes,
# each within a factor of 2 of the others, so any free buffer fits any of them).
BIG = make_layout(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16)
NUM_CACHE_BLOCKS = 96
NUM_PER_BATCH = 6


def source_cache() -> KVCache:
    """The prefill side's blocks, the same in every process (seeded)."""
    cache = KVCache(BIG, NUM_CACHE_BLOCKS, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    return cache


def batches(prefix: str) -> list[list[tuple[str, list[int]]]]:
    """Two batches of (transfer id, the source block ids it exports); no two layers carry
    the same bytes. Batch 0 starts with its longest prompt, batch 1 with its shortest, so
    the first layer of batch 1 fits any buffer batch 0 left in the pool."""
    gen = torch.Generator().manual_seed(1)
    lengths = [[48 - 4 * (i % 4) for i in range(NUM_PER_BATCH)],
               [36 + 4 * (i % 4) for i in range(NUM_PER_BATCH)]]
    return [[(f"{prefix}-{b}-{i}", torch.randperm(NUM_CACHE_BLOCKS, generator=gen)[:n].tolist())
             for i, n in enumerate(lengths[b])] for b in range(2)]


def wait_for_pool_idle(pool, timeout_s: float = 5.0) -> dict[str, int]:
    """The pool's stats once nothing is lent (zmq lets go of sent frames asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (stats := pool.stats())["num_lent"] and time.monotonic() < deadline:
        time.sleep(0.02)
    return stats


def export_and_send(backend: str, address: str, work: list[list[tuple[str, list[int]]]], results,
                    premature_release: bool = False) -> None:
    """Child process: the prefill side. Each batch's layers are exported and handed over
    back to back, as fast as the export copy goes, so layers pile up in flight while
    buffers come back; then the batch is awaited and the pool's stats sent to the test.
    `premature_release`: give each buffer back as soon as its frames are queued (the bug
    the pool must not have), to show the receiver's checks catch it."""
    torch.set_num_threads(1)
    import transport.channel as channel
    import transport.paths.inline as inline_path

    inline_path.INLINE_FRAME_BYTES = 1 << 20  # several frames per layer
    if premature_release:
        send_layer = channel.PeerChannel._send_layer
        channel.PeerChannel._send_layer = lambda *a, **k: (send_layer(*a, **k), lambda: True)[1]
    cache, sender = source_cache(), make_sender(config(backend), KEY)
    for batch_idx, batch in enumerate(work):
        sinks = [sender.open(tid, address, BIG) for tid, _ in batch]
        for sink, (_, block_ids) in zip(sinks, batch, strict=True):
            for layer_idx in range(BIG.num_layers):
                export_layer(cache, layer_idx, KVExport(sink, block_ids))
            sink.on_complete(7)
        for sink in sinks:
            error = sink.result.exception(TIMEOUT_S)
            results.put((sink.transfer_id, "ok" if error is None else type(error).__name__))
        results.put((f"stats-{batch_idx}", wait_for_pool_idle(sender.export_pool)))
    sender.close()


def run_transfers(backend: str, premature_release: bool = False) -> tuple[dict, MemoryTarget, dict]:
    """Both batches, one after the other; returns the reservations, the target, and per
    transfer (sender's outcome, receiver's outcome), plus the pool's stats per batch."""
    work = batches(backend)
    target = MemoryTarget(BIG, sum(len(ids) for batch in work for _, ids in batch))
    rx = make_receiver(config(backend), target, KEY)
    results = mp.get_context("spawn").Queue()
    try:
        reservations = {tid: target.reserve(tid, len(ids)) for batch in work for tid, ids in batch}
        for tid, res in reservations.items():
            rx.expect(tid, res)
        proc = spawn(export_and_send, backend, rx.address, work, results, premature_release)
        outcome = collect(results, len(reservations) + 2, TIMEOUT_S * 2)
        proc.join(10)
        for tid in reservations:
            try:
                outcome[tid] = (outcome.get(tid), rx.wait(tid, 1).token_id)
            except TransferError as exc:
                outcome[tid] = (outcome.get(tid), type(exc).__name__)
    finally:
        rx.close()
    return reservations, target, outcome


@pytest.mark.parametrize("backend", ["zmq", "zmq-inline", "shm", "nccl"])
def test_many_large_layers_back_to_back_land_bit_identical(backend):
    reservations, target, outcome = run_transfers(backend)
    first, second = outcome.pop("stats-0"), outcome.pop("stats-1")
    assert outcome == {tid: ("ok", 7) for tid in reservations}
    cache = source_cache()
    for tid, block_ids in (job for batch in batches(backend) for job in batch):
        for layer_idx in range(BIG.num_layers):
            sent = cache.layers[layer_idx][:, block_ids]
            assert torch.equal(target.read(reservations[tid], layer_idx).view(torch.uint8),
                               sent.view(torch.uint8)), (tid, layer_idx)
    assert second["num_reused"] > first["num_reused"], second  # buffers did cycle
    assert second["num_lent"] == 0 and second["bytes_owned"] <= second["max_bytes"], second


def test_a_buffer_given_back_while_zmq_still_sends_it_is_caught():
    """The control: releasing at queue time (not when the frames are done) lets the next
    export overwrite layers libzmq is still sending, and the receiver's checksum refuses
    them. (Whether an overwrite lands mid-send is a race; a few tries make it certain.)"""
    for _ in range(3):
        _, _, outcome = run_transfers("zmq-inline", premature_release=True)
        stats = outcome.pop("stats-1")
        outcome.pop("stats-0")
        assert stats["num_reused"] > 0, stats
        if "TransferCorrupt" in {rx_side for _, rx_side in outcome.values()}:
            return
    pytest.fail(f"no overwrite in flight was caught: {outcome}")


def test_no_buffer_stays_lent_after_failed_or_cancelled_transfers():
    """A transfer the receiver refuses, one it cancels mid-stream, one the engine aborts
    between lending and handing over, and one to a peer that never reads: each ends with
    its buffers back in the pool, and the pool within its bound. The last one's buffers
    stay out while libzmq still holds their frames, until the sender closes its socket."""
    cache, target = source_cache(), MemoryTarget(BIG, 256)
    rx = make_receiver(config("zmq-inline", reservation_ttl_s=5), target, KEY)
    tx = make_sender(config("zmq-inline", transfer_timeout_s=1.5), KEY)
    block_ids = list(range(40))
    try:
        refused = tx.open("never-expected", rx.address, BIG)
        res = target.reserve("cancelled", len(block_ids))
        rx.expect("cancelled", res)
        cancelled = tx.open("cancelled", rx.address, BIG)
        export_layer(cache, 0, KVExport(cancelled, block_ids))
        rx.cancel("cancelled")
        for layer_idx in range(BIG.num_layers):
            export_layer(cache, layer_idx, KVExport(refused, block_ids))
        for layer_idx in range(1, BIG.num_layers):
            export_layer(cache, layer_idx, KVExport(cancelled, block_ids))
        aborted = tx.open("aborted", rx.address, BIG)
        aborted.export_buffer(BIG.layer_nbytes(len(block_ids)))
        aborted.on_abort("engine error during the export copy")
        for sink in (refused, cancelled, aborted):
            with pytest.raises(TransferError):
                sink.wait(10)
        assert wait_for_pool_idle(tx.export_pool)["num_lent"] == 0
        tx.export_pool.check_integrity()
        assert target.num_free_blocks == 256
        with socket.create_server(("127.0.0.1", 0)) as mute:  # accepts, never speaks ZMTP
            address = dataclasses.replace(PeerAddress.parse(rx.address), port=mute.getsockname()[1])
            silent = tx.open("silent", str(address), BIG)
            for layer_idx in range(BIG.num_layers):
                export_layer(cache, layer_idx, KVExport(silent, block_ids))
            with pytest.raises(TransferTimeout):
                silent.wait(10)
            assert tx.export_pool.stats()["num_draining"] == BIG.num_layers  # frames still queued
    finally:
        rx.close()
        tx.close()  # the sockets close and libzmq drops the frames it held
    stats = wait_for_pool_idle(tx.export_pool)
    assert stats["num_lent"] == 0 and stats["bytes_owned"] <= stats["max_bytes"], stats
