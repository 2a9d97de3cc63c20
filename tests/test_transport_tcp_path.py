"""The `tcp` data path on real sockets: payloads land straight in scattered blocks, only
keyed connections get in, a refused layer is drained so the pair stays in step, and a
sender that stalls or dies mid-layer fails its transfer promptly with every block back.

`RawPeer` speaks the wire protocol by hand (an authenticated HELLO and LAYER headers on
ZMQ, bytes on the data connection) so a test can stop a layer half way."""

from __future__ import annotations

import socket
import time

import pytest
import torch
import zmq

from tests.test_transport_backends import KEY, LAYOUT, config
from tests.test_transport_faults import assert_still_serves, send_all
from transport.address import PeerAddress
from transport.base import PeerGone, TransferAborted, TransferCorrupt, TransferTimeout
from transport.factory import make_receiver, make_sender
from transport.memory_target import MemoryTarget, synthetic_layers
from transport.paths.tcp_accept import PREAMBLE_LEN, new_token, preamble
from transport.wire import DONE, HELLO, LAYER, TCP, Header, WireCodec, payload_checksum
from workers.engine.kv_cache import tensor_bytes


class RawPeer:
    """A hand-driven sender: one DEALER socket and one data connection to `address`."""

    def __init__(self, address: str) -> None:
        self.addr = PeerAddress.parse(address)
        self.codec = WireCodec(KEY)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.addr.endpoint)
        token = new_token()
        self.data = socket.create_connection((self.addr.host, self.addr.data_port), timeout=5)
        self.data.sendall(preamble(KEY, token))
        self.send(Header(HELLO, "", data_path=TCP, extra={"token": token.hex()}))

    def send(self, header: Header) -> None:
        self.sock.send_multipart(self.codec.seal(header))

    def layer_header(self, tid: str, seq: int, layer_idx: int, kv: torch.Tensor,
                     checksum: int | None = None) -> Header:
        data = tensor_bytes(kv)
        return Header(LAYER, tid, seq=seq, layer_start=layer_idx, layer_end=layer_idx + 1,
                      dtype=LAYOUT.dtype, shape=[1, *kv.shape], block_size=LAYOUT.block_size,
                      fingerprint=LAYOUT.fingerprint(), nbytes=len(data),
                      checksum=payload_checksum(data) if checksum is None else checksum,
                      data_path=TCP)

    def send_layer(self, tid: str, seq: int, layer_idx: int, kv: torch.Tensor,
                   upto: int | None = None, checksum: int | None = None) -> None:
        self.send(self.layer_header(tid, seq, layer_idx, kv, checksum))
        self.data.sendall(tensor_bytes(kv)[:upto])

    def send_transfer(self, tid: str, layers: list[torch.Tensor], first_token: int) -> None:
        for i, kv in enumerate(layers):
            self.send_layer(tid, i, i, kv)
        self.send(Header(DONE, tid, seq=len(layers), first_token_id=first_token))

    def close(self) -> None:
        self.data.close()
        self.sock.close(0)
        self.ctx.term()


def tcp_path_of(rx):
    (path,) = [p for p in rx._paths.values() if p.name == TCP]
    return path


def wait_until_reading(rx) -> None:
    """Until the receiver is taking a layer off the data connection (the header is in)."""
    deadline = time.monotonic() + 5
    while not tcp_path_of(rx)._reading:
        assert time.monotonic() < deadline, "the layer's header never reached the receiver"
        time.sleep(0.01)


@pytest.fixture
def tcp_receiver():
    target = MemoryTarget(LAYOUT, 32)
    rx = make_receiver(config("zmq", reservation_ttl_s=3, connect_timeout_s=1.5), target, KEY)
    assert PeerAddress.parse(rx.address).data_paths == ("inline", "tcp")
    yield rx, target
    rx.close()


def test_layers_land_straight_in_scattered_blocks(tcp_receiver):
    rx, target = tcp_receiver
    first = target.reserve("first", 6)
    target.reserve("second", 4)
    target.cancel_kv(first)
    res = target.reserve("scattered", 24)  # blocks 10..31 then 0..1: two runs per half
    assert res.block_ids[-2:] == [0, 1]
    rx.expect("scattered", res)
    tx = make_sender(config("zmq"), KEY)
    layers = synthetic_layers(LAYOUT, 24, 5)
    send_all(tx.open("scattered", rx.address, LAYOUT), layers, 9)
    assert rx.wait("scattered", 10).token_id == 9
    for i, kv in enumerate(layers):
        assert torch.equal(target.read(res, i), kv), i
    assert rx.metrics.snapshot()["bytes_total"] == {"tcp": sum(kv.numel() * 4 for kv in layers)}
    tx.close()


def test_data_connections_without_the_key_are_refused_and_counted(tcp_receiver):
    rx, target = tcp_receiver
    addr = PeerAddress.parse(rx.address)
    garbage = socket.create_connection((addr.host, addr.data_port), timeout=5)
    garbage.sendall(b"\x00" * PREAMBLE_LEN)
    silent = socket.create_connection((addr.host, addr.data_port), timeout=5)
    assert garbage.recv(1) == b""  # closed on the spot
    assert silent.recv(1) == b""  # closed when its preamble did not come in time
    rejected = rx.metrics.snapshot()["rejections_total"]
    assert rejected["bad_mac"] == 1 and rejected["timeout"] == 1
    garbage.close()
    silent.close()
    assert_still_serves(rx, target)


def test_a_refused_layer_is_drained_and_the_pair_stays_in_step(tcp_receiver):
    rx, target = tcp_receiver
    tx = make_sender(config("zmq"), KEY)
    refused = tx.open("never-expected", rx.address, LAYOUT)
    send_all(refused, synthetic_layers(LAYOUT, 8, 1))
    with pytest.raises(Exception, match="not expected"):
        refused.wait(10)
    (channel,) = tx._channels.values()
    res = target.reserve("next", 2)
    rx.expect("next", res)
    send_all(tx.open("next", rx.address, LAYOUT), synthetic_layers(LAYOUT, 2, 3), 77)
    assert rx.wait("next", 10).token_id == 77
    assert list(tx._channels.values()) == [channel] and not channel.path.broken  # same stream
    assert rx.metrics.snapshot()["rejections_total"] == {"unknown": LAYOUT.num_layers + 1}
    tx.close()


def start_a_layer(rx, target, tid: str, upto: int, timeout: float) -> RawPeer:
    """A transfer of 4 blocks whose first layer stops after `upto` bytes, from a hand-driven
    peer the test then leaves silent or kills."""
    rx.expect(tid, target.reserve(tid, 4), timeout=timeout)
    peer = RawPeer(rx.address)
    peer.send_layer(tid, 0, 0, synthetic_layers(LAYOUT, 4, 2)[0], upto=upto)
    return peer


def assert_fails_within(rx, target, tid: str, error: type, seconds: float) -> None:
    start = time.monotonic()
    with pytest.raises(error):
        rx.wait(tid, 5)
    assert time.monotonic() - start < seconds
    assert target.num_free_blocks == 32  # freed once the writer let go, not under it
    target.check_integrity()


def test_a_layer_stalled_mid_way_fails_promptly_when_cancelled(tcp_receiver):
    rx, target = tcp_receiver
    peer = start_a_layer(rx, target, "stalled", LAYOUT.layer_nbytes(4) // 2, timeout=30)
    wait_until_reading(rx)  # the receiver is now writing it into the blocks
    rx.cancel("stalled")
    assert_fails_within(rx, target, "stalled", TransferAborted, 2)
    peer.close()
    assert_still_serves(rx, target)


def test_a_layer_stalled_mid_way_expires_with_its_reservation(tcp_receiver):
    rx, target = tcp_receiver
    peer = start_a_layer(rx, target, "expiring", 100, timeout=1.0)
    assert_fails_within(rx, target, "expiring", TransferTimeout, 2.5)
    peer.close()
    assert_still_serves(rx, target)


def test_a_sender_that_dies_mid_layer_fails_its_transfer_at_once(tcp_receiver):
    rx, target = tcp_receiver
    peer = start_a_layer(rx, target, "dies", 1000, timeout=30)
    wait_until_reading(rx)
    peer.close()  # both connections drop, as when the process is killed
    assert_fails_within(rx, target, "dies", PeerGone, 2)
    assert_still_serves(rx, target)


def test_a_wrong_checksum_fails_one_transfer_and_the_stream_stays_usable(tcp_receiver):
    rx, target = tcp_receiver
    layers = synthetic_layers(LAYOUT, 3, 6)
    res = target.reserve("bad-sum", 3)
    rx.expect("bad-sum", res)
    peer = RawPeer(rx.address)
    peer.send_layer("bad-sum", 0, 0, layers[0], checksum=12345)
    with pytest.raises(TransferCorrupt):
        rx.wait("bad-sum", 5)
    assert target.num_free_blocks == 32
    good = target.reserve("good", 3)
    rx.expect("good", good)
    peer.send_transfer("good", layers, 11)
    assert rx.wait("good", 5).token_id == 11
    assert all(torch.equal(target.read(good, i), kv) for i, kv in enumerate(layers))
    peer.close()


def test_curve_receivers_do_not_offer_the_unencrypted_path():
    rx = make_receiver(config("zmq", curve=True), MemoryTarget(LAYOUT, 4), KEY)
    try:
        addr = PeerAddress.parse(rx.address)
        assert addr.data_paths == ("inline",) and addr.data_port == 0
    finally:
        rx.close()


@pytest.mark.parametrize("text", [
    "tcp://127.0.0.1:5000?node=n&paths=inline,tcp",  # tcp without its port
    "tcp://127.0.0.1:5000?node=n&paths=inline&data_port=6000",  # a port for no path
    "tcp://127.0.0.1:5000?node=n&paths=inline,tcp&data_port=99999",
])
def test_addresses_with_a_bad_data_port_are_refused(text):
    with pytest.raises(ValueError, match="data_port"):
        PeerAddress.parse(text)


def test_address_round_trips_the_data_port():
    addr = PeerAddress("tcp", "10.0.0.7", 5000, "node", ("inline", "tcp"), data_port=6001)
    assert PeerAddress.parse(str(addr)) == addr


def test_senders_that_went_away_leave_no_connection_or_thread_behind(tcp_receiver):
    """Prefill replicas restart and scale down: each new sender's handshake retires the
    data connections and worker threads of senders whose end has closed."""
    rx, target = tcp_receiver
    for i in range(4):
        tx = make_sender(config("zmq"), KEY)
        res = target.reserve(f"churn-{i}", 2)
        rx.expect(f"churn-{i}", res)
        send_all(tx.open(f"churn-{i}", rx.address, LAYOUT), synthetic_layers(LAYOUT, 2, i), i)
        assert rx.wait(f"churn-{i}", 10).token_id == i
        target.commit(res)
        tx.close()
    tcp = tcp_path_of(rx)
    time.sleep(0.2)  # the last close reaches the receiver
    assert tcp.num_connections() == 1 and rx.num_peer_workers == 1  # only the last sender's
    assert_still_serves(rx, target)  # a fifth sender: the fourth is retired in turn
    assert tcp.num_connections() == 1 and rx.num_peer_workers == 1


def test_a_new_sender_leaves_live_idle_senders_connected(tcp_receiver):
    """Retiring gone senders must not touch live ones that are merely quiet: the first
    sender's next transfer still goes over its first connection."""
    rx, target = tcp_receiver
    first, second = make_sender(config("zmq"), KEY), make_sender(config("zmq"), KEY)
    try:
        for i, tx in enumerate((first, second, first)):
            tid = f"quiet-{i}"
            res = target.reserve(tid, 2)
            rx.expect(tid, res)
            start = time.monotonic()
            send_all(tx.open(tid, rx.address, LAYOUT), synthetic_layers(LAYOUT, 2, i), i)
            assert rx.wait(tid, 10).token_id == i
            assert time.monotonic() - start < 1.0  # the HELLO's look at idle peers is instant
            target.commit(res)
        (channel,) = first._channels.values()
        assert not channel.broken and not channel.path.broken
        assert tcp_path_of(rx).num_connections() == 2 and rx.num_peer_workers == 2
    finally:
        first.close()
        second.close()
