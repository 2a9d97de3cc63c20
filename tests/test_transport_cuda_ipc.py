"""The `shm` data path's CUDA IPC half (`transport/paths/cuda_ipc.py`, `transport/paths/shm_cuda.py`).

This machine has no GPU, so the CPU tests run the protocol (probe, device slots named in
authenticated headers, RELEASE watermark, refusals) over real ZMQ sockets with
`HostStandIn`, a stand-in for CUDA IPC whose "device memory" is host tensors one process
can name to itself. Whatever needs real CUDA IPC (two processes, bf16 on the GPU, a decode
engine continuing after import) is in `tests/test_transport_cuda_gpu.py` and
`python -m cluster.bench.gpu_check`.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.test_transport_backends import KEY, TIMEOUT_S, config
from transport.base import TransferCorrupt, TransferRejected
from transport.memory_target import MemoryTarget, make_layout, synthetic_layers
from transport.paths.cuda_ipc import (
    MAX_HANDLE_BYTES,
    CudaIpcMemory,
    IpcHandle,
    IpcMemory,
    cuda_ipc_for,
)
from transport.paths.inline import InlineRecvPath
from transport.paths.shm import ShmRecvPath, ShmSendPath
from transport.paths.shm_cuda import (
    MAX_DEVICE_MAPPINGS,
    PROBE,
    SEQ,
    TAKES_IPC,
    DeviceSlotPool,
    ShmDeviceReceiver,
)
from transport.receiver import ZmqReceiver
from transport.sender import ZmqSender
from transport.wire import HELLO, LAYER, RELEASE, SHM, Header, WireCodec

LAYOUT = make_layout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=16)
HANDLE = IpcHandle(bytes(range(66)), 2 << 20, 1 << 20, "/torch_4242_17_3", 5)


class HostStandIn(IpcMemory):
    """Stands in for CUDA IPC, which cannot run here: "device" buffers are host tensors in
    a registry this process shares with itself, opened by handle like the real thing."""

    def __init__(self, registry: dict[bytes, torch.Tensor] | None = None,
                 budget: int = 1 << 40) -> None:
        self.registry = {} if registry is None else registry
        self.budget, self.num_fences, self.num_opens = budget, 0, 0

    def holds(self, kv: torch.Tensor) -> bool:
        return kv.device.type == "cpu"

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, IpcHandle]:
        if nbytes > self.budget:
            raise torch.cuda.OutOfMemoryError("stand-in out of memory")
        self.budget -= nbytes
        data, handle = torch.zeros(nbytes, dtype=torch.uint8), os.urandom(66)
        self.registry[handle] = data
        return data, IpcHandle(handle, 0, nbytes, "/torch_standin", 0)

    def open(self, handle: IpcHandle) -> torch.Tensor:
        self.num_opens += 1
        return self.registry[handle.handle][handle.offset:handle.offset + handle.size]

    def fence(self) -> None:
        self.num_fences += 1


# -- the handle description -------------------------------------------------------------------

def test_handle_round_trips_through_the_authenticated_header():
    codec = WireCodec(KEY)
    header = Header(LAYER, "t1", data_path=SHM, extra={**HANDLE.to_extra(), SEQ: 7})
    opened = codec.open(*codec.seal(header))
    assert IpcHandle.from_extra(opened.extra) == HANDLE
    assert opened.extra[SEQ] == 7


@pytest.mark.parametrize("change", [
    {"ipc": "zz" * 33}, {"ipc": "abc"}, {"ipc": "AB" * 33}, {"ipc": "ab cd"}, {"ipc": ""},
    {"ipc": "ab" * (MAX_HANDLE_BYTES + 1)}, {"ipc": 5}, {"ipc_size": 0}, {"ipc_size": -1},
    {"ipc_offset": -1}, {"ipc_offset": True}, {"ipc_size": 1 << 41}, {"ipc_ref": "/../etc/passwd"},
    {"ipc_ref": "torch_no_slash"}, {"ipc_ref": 3}, {"ipc_ref_offset": -2}, {"ipc_ref_offset": "0"},
])
def test_malformed_handles_are_refused(change):
    with pytest.raises(ValueError):
        IpcHandle.from_extra({**HANDLE.to_extra(), **change})


def test_missing_keys_are_refused():
    for key in HANDLE.to_extra():
        extra = HANDLE.to_extra()
        del extra[key]
        with pytest.raises(ValueError):
            IpcHandle.from_extra(extra)


def test_an_oversized_handle_never_gets_past_the_header_parser():
    codec = WireCodec(KEY)
    header = Header(LAYER, "t1", data_path=SHM, extra={**HANDLE.to_extra(), "ipc": "ab" * 4096})
    with pytest.raises((TransferCorrupt, TransferRejected)):
        codec.open(*codec.seal(header))


# -- the receiver refuses cleanly -------------------------------------------------------------

def _layer_header(extra: dict, nbytes: int = 64) -> Header:
    return Header(LAYER, "t1", dtype="float32", nbytes=nbytes, data_path=SHM, extra=extra)


@pytest.mark.parametrize("extra", [
    {**HANDLE.to_extra(), "ipc": "nothex"},  # malformed handle
    {**HANDLE.to_extra()},  # no send number
    {**HANDLE.to_extra(), SEQ: -1},
    {**HANDLE.to_extra(), "ipc_size": 8, SEQ: 1},  # smaller than the payload
])
def test_receiver_refuses_a_malformed_slot_reference(extra):
    rx = ShmDeviceReceiver(HostStandIn())
    with pytest.raises(TransferCorrupt):
        rx.read(_layer_header(extra), [], (16,), lambda h: None)


def test_receiver_refuses_frames_with_a_device_slot():
    rx = ShmDeviceReceiver(HostStandIn())
    with pytest.raises(TransferCorrupt):
        rx.read(_layer_header({**HANDLE.to_extra(), SEQ: 1}), [b"x" * 64], (16,), lambda h: None)


def test_a_handle_that_cannot_be_opened_is_a_clean_rejection():
    """The real CUDA opener on a machine without CUDA: what a sender on another node (or
    a GPU this process cannot see) looks like to the receiver."""
    for memory in (CudaIpcMemory(), HostStandIn()):  # no CUDA here; unknown handle
        rx = ShmDeviceReceiver(memory)
        with pytest.raises(TransferRejected) as info:
            rx.read(_layer_header({**HANDLE.to_extra(), SEQ: 1}), [], (16,), lambda h: None)
        assert info.value.reason == "cuda_ipc_open"


def test_a_host_receiver_refuses_device_slots_and_says_no_to_the_probe():
    rx, replies = ShmRecvPath(), []
    with pytest.raises(TransferRejected) as info:
        rx.read(b"p", _layer_header({**HANDLE.to_extra(), SEQ: 1}), [], (16,), replies.append)
    assert info.value.reason == "cuda_ipc_unsupported"
    rx.on_hello(b"p", Header(HELLO, "", data_path=SHM, extra=HANDLE.to_extra()), replies.append)
    assert [(h.kind, h.transfer_id, h.extra) for h in replies] == [(RELEASE, "", {TAKES_IPC: 0})]


def test_probe_answer():
    memory = HostStandIn()
    probe, handle = memory.allocate(16)
    probe.copy_(torch.arange(16, dtype=torch.uint8))
    hello = Header(HELLO, "", data_path=SHM, extra={**handle.to_extra(), PROBE: bytes(range(16)).hex()})
    assert ShmDeviceReceiver(memory).answer_hello(hello).extra == {TAKES_IPC: 1}
    wrong = Header(HELLO, "", data_path=SHM, extra={**handle.to_extra(), PROBE: bytes(16).hex()})
    assert ShmDeviceReceiver(memory).answer_hello(wrong).extra == {TAKES_IPC: 0}
    assert ShmDeviceReceiver(CudaIpcMemory()).answer_hello(hello).extra == {TAKES_IPC: 0}
    assert ShmDeviceReceiver(memory).answer_hello(Header(HELLO, "")).extra == {TAKES_IPC: 0}


# -- the sender's device slots -----------------------------------------------------------------

def test_pool_reuses_a_slot_only_after_its_release():
    pool = DeviceSlotPool(HostStandIn(), pool_bytes=300)
    a, b = pool.lend(100), pool.lend(100)
    assert b is not a and (a.lent_seq, b.lent_seq) == (1, 2)
    assert pool.lend(200) is None  # 200 owned + 200 > 300: inline instead
    c = pool.lend(100)
    assert pool.lend(1) is None  # all three lent, the pool at its cap
    pool.release_through(a.lent_seq)
    assert pool.lend(50) is a and a.lent_seq == 4
    pool.release_through(1)  # a stale RELEASE frees nothing lent since
    assert (a.lent_seq, b.lent_seq, c.lent_seq) == (4, 2, 3)
    pool.release_through(3)  # a later send's RELEASE: the receiver is done with b too
    assert [s.lent_seq for s in (a, b, c)] == [4, -1, -1]
    pool.check_integrity()


def test_pool_prefers_the_smallest_fitting_most_recently_freed_slot():
    pool = DeviceSlotPool(HostStandIn(), pool_bytes=1000)
    small, big, small2 = (pool.lend(n) for n in (100, 400, 100))
    assert len({id(small), id(big), id(small2)}) == 3
    pool.release_through(big.lent_seq)  # frees small, big
    pool.release_through(small2.lent_seq)  # frees small2, last
    assert pool.lend(80) is small2
    assert pool.lend(150) is big
    pool.check_integrity()


def test_a_failed_allocation_caps_the_pool():
    pool = DeviceSlotPool(HostStandIn(budget=150), pool_bytes=1000)
    slot = pool.lend(100)
    assert pool.lend(100) is None and pool.pool_bytes == 100
    assert pool.lend(10) is None  # no retry per layer
    pool.release_through(slot.lent_seq)
    assert pool.lend(10) is slot
    pool.check_integrity()


def test_host_behaviour_is_unchanged_without_cuda():
    assert cuda_ipc_for("cpu") is None
    path = ShmSendPath(1 << 20)
    kv = torch.randn(2, 1, 16, 2, 16)
    header = Header(LAYER, "t1", nbytes=kv.numel() * 4, data_path=SHM)
    try:
        assert path.hello() is None
        assert path.payload(header, kv) == []
        assert set(header.extra) == {"file", "size"} and header.checksum != 0
    finally:
        path.close()


def test_device_slots_wait_for_the_receivers_yes():
    path = ShmSendPath(1 << 20, HostStandIn())
    kv = torch.randn(2, 1, 16, 2, 16)
    try:
        hello = path.hello()
        assert hello.kind == HELLO and PROBE in hello.extra
        before = Header(LAYER, "t1", nbytes=kv.numel() * 4, data_path=SHM)
        path.payload(before, kv)
        assert "file" in before.extra  # no answer yet: a host slot, as ever
        path.on_release(Header(RELEASE, "", extra={TAKES_IPC: 1}))
        after = Header(LAYER, "t1", nbytes=kv.numel() * 4, data_path=SHM)
        assert path.payload(after, kv) == []
        assert "ipc" in after.extra and after.checksum == 0 and after.extra[SEQ] == 1
    finally:
        path.close()


def test_a_full_device_pool_sends_inline():
    path = ShmSendPath(256, HostStandIn())
    kv = torch.randn(2, 1, 16, 2, 2)  # 512 bytes: more than the pool
    try:
        path.on_release(Header(RELEASE, "", extra={TAKES_IPC: 1}))
        header = Header(LAYER, "t1", nbytes=kv.numel() * 4, data_path=SHM)
        frames = path.payload(header, kv)
        assert header.data_path == "inline" and b"".join(bytes(f) for f in frames) == kv.numpy().tobytes()
    finally:
        path.close()


def test_receiver_keeps_a_bounded_number_of_mappings():
    memory = HostStandIn()
    rx = ShmDeviceReceiver(memory)
    handles = [memory.allocate(64)[1] for _ in range(MAX_DEVICE_MAPPINGS + 6)]
    for seq, handle in enumerate(handles):
        rx.read(_layer_header({**handle.to_extra(), SEQ: seq}), [], (16,), lambda h: None)
    rx.read(_layer_header({**handles[-1].to_extra(), SEQ: 99}), [], (16,), lambda h: None)
    assert len(rx._mappings) == MAX_DEVICE_MAPPINGS  # noqa: SLF001
    assert memory.num_opens == len(handles)  # the cached one was not opened again


# -- the whole protocol over real sockets, with the stand-in for CUDA IPC -----------------------

def test_transfers_through_device_slots_over_real_sockets():
    registry: dict[bytes, torch.Tensor] = {}
    tx_memory, rx_memory = HostStandIn(registry), HostStandIn(registry)
    target = MemoryTarget(LAYOUT, 32)
    rx = ZmqReceiver(config("shm"), target, KEY, [InlineRecvPath(), ShmRecvPath(rx_memory)])
    paths: list[ShmSendPath] = []

    def choose_path(peer) -> ShmSendPath:
        paths.append(ShmSendPath(1 << 20, tx_memory))
        return paths[-1]

    tx = ZmqSender(config("shm"), KEY, choose_path)
    try:
        for i in range(4):
            tid = f"ipc-{i}"
            res = target.reserve(tid, 2)
            rx.expect(tid, res)
            sink = tx.open(tid, rx.address, LAYOUT)
            layers = synthetic_layers(LAYOUT, 2, seed=i)
            for layer_idx, kv in enumerate(layers):
                sink.on_layer(layer_idx, kv)
            sink.on_complete(i)
            assert rx.wait(tid, TIMEOUT_S).token_id == i
            sink.wait(TIMEOUT_S)
            for layer_idx, kv in enumerate(layers):
                assert torch.equal(target.read(res, layer_idx), kv)
            target.commit(res)
        device = paths[0]._device  # noqa: SLF001 - the bookkeeping under test
        assert device.peer_takes_ipc
        assert device.pool.slots and all(s.lent_seq < 0 for s in device.pool.slots)
        # each slot opened once, plus the probe
        assert 2 <= rx_memory.num_opens <= len(device.pool.slots) + 1
        assert rx_memory.num_fences >= LAYOUT.num_layers  # one per device layer read
        device.pool.check_integrity()
        target.check_integrity()
    finally:
        tx.close()
        rx.close()
