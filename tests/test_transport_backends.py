"""Each network backend between real processes: content, order, concurrency, and the local
backend in-process. Receivers live in the test process on a `MemoryTarget` (a block pool
with the engine's bookkeeping); senders are spawned processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time

import pytest
import torch

from transport.config import TransportConfig
from transport.factory import make_receiver, make_sender
from transport.memory_target import MemoryTarget, make_layout, synthetic_layers

KEY = b"test-transport-key-0123456789abcdef"  # what the app builder would hand out
LAYOUT = make_layout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16)
TIMEOUT_S = 20.0


def config(backend: str, **kw) -> TransportConfig:
    """`zmq-inline`: the zmq backend with payloads in ZMQ frames (no `tcp` data path)."""
    if backend == "zmq-inline":
        backend = "zmq"
        kw.setdefault("direct_tcp", False)
    kw.setdefault("transfer_timeout_s", TIMEOUT_S)
    kw.setdefault("reservation_ttl_s", TIMEOUT_S)
    kw.setdefault("connect_timeout_s", TIMEOUT_S)
    return TransportConfig(backend=backend, host="127.0.0.1", **kw)


def send_transfers(backend: str, jobs: list[tuple[str, str, int, int]], results,
                   die_after_layers: int = -1) -> None:
    """Child process: stream every job's layers interleaved, as a batched prefill would.

    jobs: (transfer_id, receiver address, num_blocks, seed); the first token is the seed.
    """
    torch.set_num_threads(1)
    sender = make_sender(config(backend), KEY)
    sinks = [sender.open(tid, addr, LAYOUT) for tid, addr, _, _ in jobs]
    layers = [synthetic_layers(LAYOUT, n, seed) for _, _, n, seed in jobs]
    for layer_idx in range(LAYOUT.num_layers):
        for sink, kv in zip(sinks, layers, strict=True):
            sink.on_layer(layer_idx, kv[layer_idx])
        if layer_idx + 1 == die_after_layers:
            time.sleep(0.2)  # let the layers leave, then die without a word
            os._exit(3)
    for sink, (_, _, _, seed) in zip(sinks, jobs, strict=True):
        sink.on_complete(seed)
    for sink in sinks:
        try:
            sink.wait(TIMEOUT_S)
            results.put((sink.transfer_id, "ok"))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.put((sink.transfer_id, type(exc).__name__))
    sender.close()


def spawn(target, *args):
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def collect(results, n: int, timeout_s: float = TIMEOUT_S) -> dict[str, str]:
    out, deadline = {}, time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        try:
            tid, status = results.get(timeout=0.5)
            out[tid] = status
        except queue.Empty:
            continue
    return out


@pytest.mark.parametrize("backend", ["zmq", "zmq-inline", "shm", "nccl"])
def test_concurrent_transfers_between_processes(backend):
    """10 transfers from 2 sender processes into 2 receivers at once, interleaved by layer."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    targets = [MemoryTarget(LAYOUT, 64) for _ in range(2)]
    receivers = [make_receiver(config(backend), t, KEY) for t in targets]
    jobs: list[list[tuple[str, str, int, int]]] = [[], []]
    reservations = {}
    for i in range(10):
        tid, rx = f"{backend}-req{i}-nonce", i % 2
        num_blocks = 1 + i % 4
        reservations[tid] = (rx, targets[rx].reserve(tid, num_blocks), i)
        receivers[rx].expect(tid, reservations[tid][1])
        jobs[i % 2 if i < 8 else (i + 1) % 2].append((tid, receivers[rx].address, num_blocks, i))
    procs = [spawn(send_transfers, backend, j, results) for j in jobs]
    try:
        for tid, (rx, res, seed) in reservations.items():
            assert receivers[rx].wait(tid, TIMEOUT_S).token_id == seed
            expected = synthetic_layers(LAYOUT, res.num_blocks_to_receive, seed)
            for layer_idx, kv in enumerate(expected):
                assert torch.equal(targets[rx].read(res, layer_idx), kv), (tid, layer_idx)
            order = [layer for t, layer in targets[rx].write_log if t == tid]
            assert order == list(range(LAYOUT.num_layers))
            targets[rx].commit(res)
        assert collect(results, 10) == {tid: "ok" for tid in reservations}
        for rx, target in zip(receivers, targets, strict=True):
            target.check_integrity()
            assert target.num_free_blocks == 64 and not rx.pending_ids()
            path = {"zmq": "tcp", "zmq-inline": "inline", "shm": "shm", "nccl": "pg"}[backend]
            assert set(rx.metrics.snapshot()["bytes_total"]) == {path}
    finally:
        for p in procs:
            p.join(timeout=10)
        for rx in receivers:
            rx.close()


def _send_one(tx, rx, target, layout, transfer_id, *, num_blocks, seed, first_token_id):
    """One whole transfer of synthetic layers; returns (reservation, sink, layers sent)."""
    res = target.reserve(transfer_id, num_blocks)
    rx.expect(transfer_id, res)
    sink = tx.open(transfer_id, rx.address, layout)
    layers = synthetic_layers(layout, num_blocks, seed)
    for i, kv in enumerate(layers):
        sink.on_layer(i, kv)
    sink.on_complete(first_token_id)
    assert rx.wait(transfer_id, TIMEOUT_S).token_id == first_token_id
    return res, sink, layers


def test_bf16_layers_are_bit_identical():
    layout = make_layout(dtype="bfloat16")
    target = MemoryTarget(layout, 16)
    rx = make_receiver(config("zmq"), target, KEY)
    tx = make_sender(config("zmq"), KEY)
    try:
        res, sink, layers = _send_one(tx, rx, target, layout, "bf16", num_blocks=3, seed=7,
                                      first_token_id=5)
        for i, kv in enumerate(layers):
            assert torch.equal(target.read(res, i).view(torch.int16), kv.view(torch.int16))
    finally:
        tx.close()
        rx.close()


def test_local_backend_in_process():
    target = MemoryTarget(LAYOUT, 32)
    rx = make_receiver(config("local"), target, KEY)
    tx = make_sender(config("local"), KEY)
    try:
        res, sink, layers = _send_one(tx, rx, target, LAYOUT, "loc", num_blocks=4, seed=1,
                                      first_token_id=9)
        sink.wait(TIMEOUT_S)
        assert all(torch.equal(target.read(res, i), kv) for i, kv in enumerate(layers))
        # an unknown id is refused, not written
        stray = tx.open("stray", rx.address, LAYOUT)
        stray.on_layer(0, layers[0])
        with pytest.raises(Exception, match="not expected"):
            stray.wait(TIMEOUT_S)
        target.commit(res)
        target.check_integrity()
    finally:
        tx.close()
        rx.close()


def test_address_is_advertised_not_guessed():
    target = MemoryTarget(LAYOUT, 4)
    rx = make_receiver(config("auto"), target, KEY)
    try:
        from transport.address import PeerAddress

        addr = PeerAddress.parse(rx.address)
        assert addr.host == "127.0.0.1" and addr.port > 0 and addr.node_id
        assert set(addr.data_paths) >= {"inline", "pg"}
    finally:
        rx.close()
