"""Faults and security rejections: each ends in a clear error on both sides within the
timeout, no leaked block, a counted rejection, and a receiver that keeps serving."""

from __future__ import annotations

import multiprocessing as mp
import time

import msgpack
import pytest
import torch
import zmq

from tests.test_transport_backends import KEY, LAYOUT, config, send_transfers, spawn
from transport.address import PeerAddress
from transport.base import (
    PeerGone,
    TransferAborted,
    TransferRejected,
    TransferTimeout,
)
from transport.factory import make_receiver, make_sender
from transport.memory_target import MemoryTarget, make_layout, synthetic_layers
from transport.wire import DOMAIN, DONE, LAYER, Header, WireCodec, payload_checksum

SHORT_S = 2.0


def send_all(sink, layers, first_token: int = 1) -> None:
    for i, kv in enumerate(layers):
        sink.on_layer(i, kv)
    sink.on_complete(first_token)


def assert_still_serves(rx, target, tx=None) -> None:
    """A fresh transfer after the fault completes and the pool is whole again."""
    tx = tx or make_sender(config("zmq"), KEY)
    res = target.reserve("after-fault", 2)
    rx.expect("after-fault", res)
    send_all(tx.open("after-fault", rx.address, LAYOUT), synthetic_layers(LAYOUT, 2, 3), 77)
    assert rx.wait("after-fault", 10).token_id == 77
    target.commit(res)
    target.check_integrity()
    assert target.num_free_blocks == target.num_blocks
    tx.close()


@pytest.fixture
def receiver():
    target = MemoryTarget(LAYOUT, 32)
    rx = make_receiver(config("zmq", reservation_ttl_s=SHORT_S), target, KEY)
    yield rx, target
    rx.close()


@pytest.mark.parametrize("backend", ["zmq", "zmq-inline", "nccl"])
def test_sender_dies_mid_transfer(backend):
    target = MemoryTarget(LAYOUT, 32)
    rx = make_receiver(config(backend, reservation_ttl_s=SHORT_S + 4), target, KEY)
    try:
        res = target.reserve("dies", 4)
        rx.expect("dies", res)
        results = mp.get_context("spawn").Queue()
        proc = spawn(send_transfers, backend, [("dies", rx.address, 4, 0)], results, 2)
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            rx.wait("dies")
        assert time.monotonic() - start < SHORT_S + 6
        proc.join(10)
        assert proc.exitcode == 3
        assert target.num_free_blocks == 32  # the reservation was cancelled
        assert_still_serves(rx, target)
    finally:
        rx.close()


def _serve_then_die(address_q, key_ok) -> None:
    target = MemoryTarget(LAYOUT, 32)
    rx = make_receiver(config("zmq"), target, KEY)
    rx.expect("orphan", target.reserve("orphan", 4))
    address_q.put(rx.address)
    time.sleep(60)  # killed by the test


def test_receiver_gone_mid_transfer():
    ctx = mp.get_context("spawn")
    address_q = ctx.Queue()
    proc = spawn(_serve_then_die, address_q, True)
    address = address_q.get(timeout=60)
    tx = make_sender(config("zmq", transfer_timeout_s=10), KEY)
    try:
        sink = tx.open("orphan", address, LAYOUT)
        layers = synthetic_layers(LAYOUT, 4, 0)
        sink.on_layer(0, layers[0])
        time.sleep(0.5)
        proc.kill()
        proc.join(10)
        start = time.monotonic()
        for i, kv in enumerate(layers[1:], 1):
            sink.on_layer(i, kv)
        sink.on_complete(1)
        with pytest.raises((PeerGone, TransferTimeout)):
            sink.wait(15)
        assert time.monotonic() - start < 11
    finally:
        tx.close()


def test_timeout_on_both_sides(receiver):
    rx, target = receiver
    tx = make_sender(config("zmq", transfer_timeout_s=SHORT_S), KEY)
    res = target.reserve("slow", 2)
    rx.expect("slow", res, timeout=SHORT_S)
    sink = tx.open("slow", rx.address, LAYOUT)
    sink.on_layer(0, synthetic_layers(LAYOUT, 2, 0)[0])  # and never the rest
    with pytest.raises(TransferTimeout):
        rx.wait("slow")
    with pytest.raises((TransferTimeout, TransferAborted)):
        sink.wait(SHORT_S + 2)
    assert target.num_free_blocks == 32
    assert_still_serves(rx, target, tx)


def test_bad_key_is_rejected_and_counted(receiver):
    rx, target = receiver
    res = target.reserve("auth", 2)
    rx.expect("auth", res)
    intruder = make_sender(config("zmq", transfer_timeout_s=SHORT_S), b"another-key-0123456789abcdef")
    sink = intruder.open("auth", rx.address, LAYOUT)
    send_all(sink, synthetic_layers(LAYOUT, 2, 0))
    # Its data connection is refused (PeerGone); it cannot authenticate our replies either.
    with pytest.raises((TransferTimeout, PeerGone)):
        sink.wait(SHORT_S + 2)
    deadline = time.monotonic() + 5  # the headers may still be on their way when it fails
    while rx.metrics.snapshot()["rejections_total"]["bad_mac"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rx.metrics.snapshot()["rejections_total"]["bad_mac"] >= 2  # headers and preamble
    assert not target.write_log
    intruder.close()
    with pytest.raises(TransferTimeout):
        rx.wait("auth")
    assert_still_serves(rx, target)


def test_wrong_fingerprint_is_rejected(receiver):
    rx, target = receiver
    res = target.reserve("fp", 2)
    rx.expect("fp", res)
    other = make_layout(num_layers=4, head_dim=16, block_size=16)
    other = type(other)("another-model", *[getattr(other, f) for f in
                                           ("num_layers", "num_kv_heads", "head_dim",
                                            "block_size", "dtype")])
    tx = make_sender(config("zmq"), KEY)
    sink = tx.open("fp", rx.address, other)
    send_all(sink, synthetic_layers(other, 2, 0))
    with pytest.raises(TransferRejected, match="fingerprint"):
        sink.wait(10)
    with pytest.raises(TransferRejected):
        rx.wait("fp", 10)
    assert rx.metrics.snapshot()["rejections_total"]["fingerprint"] == 1
    assert_still_serves(rx, target, tx)


def test_unknown_id_is_rejected(receiver):
    rx, target = receiver
    tx = make_sender(config("zmq"), KEY)
    sink = tx.open("never-expected", rx.address, LAYOUT)
    send_all(sink, synthetic_layers(LAYOUT, 2, 0))
    with pytest.raises(TransferRejected, match="unknown"):
        sink.wait(10)
    assert rx.metrics.snapshot()["rejections_total"]["unknown"] >= 1
    assert_still_serves(rx, target, tx)


class RawPeer:
    """A hand-driven DEALER that holds the key: replays, bad versions, oversize shapes."""

    def __init__(self, address: str, key: str = "test-transport-key-0123456789abcdef") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(PeerAddress.parse(address).endpoint)
        self.codec = WireCodec(key.encode())

    def send(self, header: Header, *payload: bytes) -> None:
        self.sock.send_multipart(self.codec.seal(header) + list(payload))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def reply(self, timeout_ms: int = 5000) -> Header:
        assert self.sock.poll(timeout_ms), "no reply"
        return self.codec.open(*self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def layer_header(tid: str, seq: int, layer: int, kv: torch.Tensor, **kw) -> tuple[Header, bytes]:
    from transport.paths.base import tensor_bytes

    data = bytes(tensor_bytes(kv))
    fields = dict(layer_start=layer, layer_end=layer + 1, dtype=LAYOUT.dtype,
                  shape=[1, *kv.shape], block_size=LAYOUT.block_size,
                  fingerprint=LAYOUT.fingerprint(), nbytes=len(data),
                  checksum=payload_checksum(data))
    fields.update(kw)
    return Header(LAYER, tid, seq, **fields), data


def test_replayed_messages_are_rejected(receiver):
    rx, target = receiver
    res = target.reserve("replay", 2)
    rx.expect("replay", res)
    layers = synthetic_layers(LAYOUT, 2, 0)
    peer = RawPeer(rx.address)
    try:
        header, data = layer_header("replay", 0, 0, layers[0])
        peer.send(header, data)
        peer.send(header, data)  # the same authenticated message again
        assert peer.reply().reason == "replay"
        for i in range(1, LAYOUT.num_layers):
            peer.send(*layer_header("replay", i, i, layers[i]))
        peer.send(Header(DONE, "replay", LAYOUT.num_layers, first_token_id=4))
        assert peer.reply().kind == "ack"
        assert rx.wait("replay", 5).token_id == 4
        peer.send(header, data)  # replay after completion
        assert peer.reply().reason == "replay"
        assert rx.metrics.snapshot()["rejections_total"]["replay"] == 2
        assert target.write_log.count(("replay", 0)) == 1
    finally:
        peer.close()
    target.commit(res)
    assert_still_serves(rx, target)


def test_protocol_version_bounds_and_garbage_are_rejected(receiver):
    rx, target = receiver
    res = target.reserve("v", 2)
    rx.expect("v", res)
    peer = RawPeer(rx.address)
    try:
        header, data = layer_header("v", 0, 0, synthetic_layers(LAYOUT, 2, 0)[0])
        header.version = 99
        peer.send(header, data)
        assert peer.reply().reason == "version"
        with pytest.raises(TransferRejected, match="version"):
            rx.wait("v", 5)
        # shapes beyond the receiver's bounds: refused before any allocation
        res2 = target.reserve("big", 2)
        rx.expect("big", res2)
        huge, _ = layer_header("big", 0, 0, synthetic_layers(LAYOUT, 2, 0)[0],
                               shape=[1, 2, 1 << 20, 16, 2, 16], nbytes=1 << 36)
        peer.send(huge)
        assert peer.reply().reason == "bounds"
        # an authenticated header that is not our msgpack map
        blob = msgpack.packb([1, 2, 3])
        peer.send_raw(blob, peer.codec.seal(Header(LAYER, "x"))[1])  # wrong MAC for blob
        import hashlib
        import hmac

        peer.send_raw(blob, hmac.new(b"test-transport-key-0123456789abcdef", DOMAIN + blob,
                                     hashlib.sha256).digest())
        peer.send_raw(b"only one frame")
        time.sleep(0.5)
        counts = rx.metrics.snapshot()["rejections_total"]
        assert counts["version"] == 1 and counts["bounds"] == 1
        assert counts["bad_mac"] == 1 and counts["malformed"] >= 2
    finally:
        peer.close()
    assert target.num_free_blocks == 32
    assert_still_serves(rx, target)


def test_oversize_frame_drops_the_peer_not_the_receiver():
    target = MemoryTarget(LAYOUT, 32)
    rx = make_receiver(config("zmq", max_layer_bytes=1 << 16), target, KEY)
    peer = RawPeer(rx.address)
    try:
        peer.send_raw(b"h", b"m", bytes(4 << 20))  # beyond MAXMSGSIZE: libzmq disconnects
        time.sleep(0.3)
        assert_still_serves(rx, target)
    finally:
        peer.close()
        rx.close()


def test_key_never_appears_in_reprs():
    cfg = config("zmq")
    assert "test-transport-key" not in repr(cfg) and "test-transport-key" not in str(cfg)
    assert "test-transport-key" not in repr(WireCodec(KEY))
