"""Payload integrity across processes' transports: a flipped byte, or a wrong checksum
handed over with a layer, fails the transfer on both sides at once, frees its blocks, and
leaves the pair in step for the next transfer."""

from __future__ import annotations

import time

import pytest
import torch

from tests.test_transport_backends import KEY, LAYOUT, config
from tests.test_transport_faults import SHORT_S, assert_still_serves, send_all
from transport.base import TransferAborted, TransferCorrupt, TransferRejected
from transport.factory import make_receiver, make_sender
from transport.memory_target import MemoryTarget, synthetic_layers
from transport.paths.inline import InlineSendPath
from transport.paths.shm import ShmSendPath
from transport.paths.tcp import TcpSendPath
from transport.sender import ZmqSender
from transport.wire import payload_checksum


class _CorruptingPath(InlineSendPath):
    def payload(self, header, kv, checksum=None):
        frames = super().payload(header, kv, checksum)
        flipped = bytearray(frames[0])
        flipped[len(flipped) // 2] ^= 0x01
        return [bytes(flipped)]


class _CorruptingShmPath(ShmSendPath):
    """Flips a byte in the slot after hashing it: the receiver's copy must catch it."""

    def payload(self, header, kv, checksum=None):
        frames = super().payload(header, kv, checksum)
        self._slots[header.extra["file"]].data[header.nbytes // 2] ^= 0x01
        return frames


class _CorruptingTcpPath(TcpSendPath):
    """Flips a byte on its way into the data connection, after the checksum was made."""

    def payload(self, header, kv, checksum=None):
        frames = super().payload(header, kv, checksum)
        flipped = bytearray(self._outgoing)
        flipped[header.nbytes // 2] ^= 0x01
        self._outgoing = memoryview(flipped)
        return frames


@pytest.mark.parametrize("backend, path", [
    ("zmq-inline", lambda addr: _CorruptingPath()),
    ("shm", lambda addr: _CorruptingShmPath(1 << 24)),
    ("zmq", lambda addr: _CorruptingTcpPath(addr, KEY, 10, 10)),
], ids=["inline", "shm", "tcp"])
def test_corrupt_frame_is_detected(backend, path):
    target = MemoryTarget(LAYOUT, 32)
    rx = make_receiver(config(backend, reservation_ttl_s=SHORT_S), target, KEY)
    tx = ZmqSender(config(backend), KEY, path)
    res = target.reserve("corrupt", 2)
    rx.expect("corrupt", res)
    sink = tx.open("corrupt", rx.address, LAYOUT)
    send_all(sink, synthetic_layers(LAYOUT, 2, 0))
    with pytest.raises(TransferCorrupt):
        rx.wait("corrupt", 10)
    with pytest.raises(TransferCorrupt):
        sink.wait(10)
    assert rx.metrics.snapshot()["rejections_total"]["checksum"] == 1
    assert res.transfer_id not in target.reservations  # the written blocks went back unused
    assert_still_serves(rx, target)
    tx.close()
    rx.close()


@pytest.mark.parametrize("backend", ["zmq", "shm", "nccl"])
def test_the_checksum_made_at_export_is_the_one_the_receiver_checks(backend):
    """A layer handed over with its checksum (as the engine's export copy makes it) is
    not hashed again by the sender: a right one lands, a wrong one fails the transfer at
    once on both sides, and the pair stays in step for the next transfer (on the
    process-group path the receiver drains the refused transfer's later layers)."""
    target = MemoryTarget(LAYOUT, 32)
    rx = make_receiver(config(backend, reservation_ttl_s=SHORT_S), target, KEY)
    tx = make_sender(config(backend), KEY)
    try:
        for name, tamper in (("right", 0), ("wrong", 1), ("after", 0)):
            layers = synthetic_layers(LAYOUT, 2, 5)
            res = target.reserve(name, 2)
            rx.expect(name, res)
            sink = tx.open(name, rx.address, LAYOUT)
            for i, kv in enumerate(layers):
                checksum = payload_checksum(kv.reshape(-1).view(torch.uint8).numpy())
                sink.on_layer(i, kv, checksum ^ (tamper if i == 1 else 0))
            sink.on_complete(1)
            if not tamper:
                sink.wait(10)
                rx.wait(name, 10)
                assert all(torch.equal(target.read(res, i), kv) for i, kv in enumerate(layers))
                target.commit(res)
                continue
            start = time.monotonic()
            with pytest.raises(TransferCorrupt):
                sink.wait(10)
            assert time.monotonic() - start < 5  # the NACK, not the 30 s transfer timeout
            assert res.transfer_id not in target.reservations
        assert rx.metrics.snapshot()["rejections_total"]["checksum"] == 1
        assert target.num_free_blocks == 32
    finally:
        tx.close()
        rx.close()


def test_a_transfer_cancelled_mid_stream_does_not_stall_the_pair():
    """The decode side gives up on a transfer (client gone) while its layers still come
    over the process group: the receiver drains them, the sender hears at once, and the
    next transfer to that peer goes through on the same group."""
    target = MemoryTarget(LAYOUT, 32)
    rx = make_receiver(config("nccl", reservation_ttl_s=SHORT_S), target, KEY)
    tx = make_sender(config("nccl"), KEY)
    try:
        layers = synthetic_layers(LAYOUT, 2, 6)
        res = target.reserve("gone", 2)
        rx.expect("gone", res)
        sink = tx.open("gone", rx.address, LAYOUT)
        sink.on_layer(0, layers[0])
        deadline = time.monotonic() + 10
        while ("gone", 0) not in target.write_log and time.monotonic() < deadline:
            time.sleep(0.01)
        rx.cancel("gone")
        start = time.monotonic()
        for i, kv in enumerate(layers[1:], 1):
            sink.on_layer(i, kv)
        sink.on_complete(1)
        with pytest.raises((TransferRejected, TransferAborted)):
            sink.wait(10)
        assert time.monotonic() - start < 5  # not the 30 s transfer timeout
        send_transfers_in_step(tx, rx, target)
        assert target.num_free_blocks == 32
    finally:
        tx.close()
        rx.close()


def send_transfers_in_step(tx, rx, target) -> None:
    layers = synthetic_layers(LAYOUT, 2, 8)
    res = target.reserve("next", 2)
    rx.expect("next", res)
    start = time.monotonic()
    send_all(tx.open("next", rx.address, LAYOUT), layers)
    rx.wait("next", 10)
    assert time.monotonic() - start < 5
    assert all(torch.equal(target.read(res, i), kv) for i, kv in enumerate(layers))
    target.commit(res)


@pytest.mark.parametrize("frame_bytes", [1000, 4096])
def test_a_layer_sent_as_many_frames_arrives_bit_identical(monkeypatch, frame_bytes):
    """Layers are cut into frames (here far smaller than the 8 MiB default, at sizes that
    split elements, blocks and K from V); they land exactly, and a flipped byte in one
    frame is still caught."""
    import transport.paths.inline as inline_path

    monkeypatch.setattr(inline_path, "INLINE_FRAME_BYTES", frame_bytes)
    target = MemoryTarget(LAYOUT, 32)
    rx = make_receiver(config("zmq", reservation_ttl_s=SHORT_S), target, KEY)
    tx = make_sender(config("zmq"), KEY)
    try:
        layers = synthetic_layers(LAYOUT, 3, 11)
        assert layers[0].numel() * layers[0].element_size() > 2 * frame_bytes
        res = target.reserve("framed", 3)
        rx.expect("framed", res)
        send_all(tx.open("framed", rx.address, LAYOUT), layers)
        rx.wait("framed", 10)
        assert all(torch.equal(target.read(res, i), kv) for i, kv in enumerate(layers))
        target.commit(res)
    finally:
        tx.close()
        rx.close()

    class _FlipInFrame(InlineSendPath):
        def payload(self, header, kv, checksum=None):
            frames = super().payload(header, kv, checksum)
            assert len(frames) > 1
            flipped = bytearray(frames[1])
            flipped[len(flipped) // 2] ^= 0x01
            return [frames[0], bytes(flipped), *frames[2:]]

    target = MemoryTarget(LAYOUT, 32)
    rx = make_receiver(config("zmq", reservation_ttl_s=SHORT_S), target, KEY)
    tx = ZmqSender(config("zmq"), KEY, lambda addr: _FlipInFrame())
    try:
        res = target.reserve("framed-bad", 2)
        rx.expect("framed-bad", res)
        send_all(tx.open("framed-bad", rx.address, LAYOUT), synthetic_layers(LAYOUT, 2, 12))
        with pytest.raises(TransferCorrupt):
            rx.wait("framed-bad", 10)
        assert target.num_free_blocks == 32
    finally:
        tx.close()
        rx.close()
