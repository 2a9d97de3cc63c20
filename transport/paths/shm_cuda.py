"""The `shm` data path's device half: CUDA layers between processes of one node by CUDA IPC.

Same protocol as the host half (`shm.py`): a LAYER header names a slot the sender
owns, the receiver copies the slot into its blocks and answers RELEASE, and the slot is
reused. Here the slot is device memory shared once through CUDA IPC (`cuda_ipc.py`), its
`IpcHandle` rides in the header's `extra`, and the receiver keeps each opened slot mapped
for the next layer that names it. Both copies stay on the GPU: slot <- layer on the
sender, blocks <- slot on the receiver; no byte crosses host memory.

Who uses it: a sender whose engine is on CUDA opens each channel with a HELLO carrying a
probe, a small shared buffer of random bytes. A receiver whose KV cache is on CUDA opens
it and compares; it answers on a RELEASE with no transfer (the one reply a channel hands
to its data path) whether that worked. Device slots go out only after a yes, and only for
layers on the probed device; before the answer, and after a no (a GPU the receiver cannot
see, a CPU cache, a torch that shares memory another way), layers are staged through host
memory as ever. So a handle that cannot be opened is found once per connection rather than
per transfer; one that still fails later is a `TransferRejected`, and the request is
prefilled locally.

Integrity: a device payload carries no checksum (checksum 0, as on the `pg` path: hashing
would cost a device-to-host copy of every layer). What protects it is the authenticated
header that names the slot, and that the memory is mapped only by processes on this node
that were handed its handle.

Ordering and reuse, with no IPC events:
- The sender synchronizes its copy into the slot before the header leaves, so the
  receiver, which learns of the slot only from that header, never reads ahead of it.
- The receiver synchronizes its copy out of the slot before it answers RELEASE, so the
  sender never overwrites a slot the receiver's GPU is still reading.
- A slot is reused only after a RELEASE for its send or for a later one (each send has a
  sequence number, `cuda_seq`, the RELEASE echoes): the receiver handles one connection's
  messages in order, so by the time it answers a later send it is done with this one,
  whether it read it or refused it unread. The end of a transfer frees nothing here,
  unlike host slots, whose late reader a checksum would catch.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from transport.base import TransferCorrupt, TransferRejected
from transport.paths.base import Received, Reply
from transport.paths.cuda_ipc import IpcHandle, IpcMemory
from transport.wire import HELLO, RELEASE, SHM, Header

log = logging.getLogger(__name__)

SEQ = "cuda_seq"  # LAYER: the send's number; RELEASE: every send up to it is done with
PROBE = "cuda_probe"  # HELLO: the random bytes the probe buffer holds, hex
TAKES_IPC = "cuda_ipc"  # RELEASE with no transfer: 1 if the probe opened and matched
PROBE_BYTES = 16
MAX_DEVICE_MAPPINGS = 64  # opened slots a receiver keeps, across all senders


def is_device_header(header: Header) -> bool:
    """A LAYER whose slot is device memory (its header names an IPC handle)."""
    return "ipc" in header.extra


@dataclass
class DeviceSlot:
    data: torch.Tensor  # uint8, the whole shared buffer
    handle: IpcHandle
    lent_seq: int = -1  # the send it is lent to; -1 = free
    freed_at: int = 0  # release tick: the latest-freed is the likeliest still in cache

    @property
    def size(self) -> int:
        return self.data.numel()


class DeviceSlotPool:
    """A sender's reusable shared device buffers, at most `pool_bytes` of them in all."""

    def __init__(self, memory: IpcMemory, pool_bytes: int) -> None:
        self.memory, self.pool_bytes = memory, pool_bytes
        self.slots: list[DeviceSlot] = []
        self._seq = self._ticks = 0

    def lend(self, nbytes: int) -> DeviceSlot | None:
        """A slot of at least `nbytes`, lent to a new send (`lent_seq` is its number);
        None when none is free and the pool is spent."""
        slot = self._free_slot(nbytes) or self._new_slot(nbytes)
        if slot is not None:
            self._seq += 1
            slot.lent_seq = self._seq
        return slot

    def _free_slot(self, nbytes: int) -> DeviceSlot | None:
        free = [s for s in self.slots if s.lent_seq < 0 and s.size >= nbytes]
        # the smallest that fits, the most recently freed among those
        return min(free, key=lambda s: (s.size, -s.freed_at), default=None)

    def _new_slot(self, nbytes: int) -> DeviceSlot | None:
        owned = self.bytes_owned
        if owned + nbytes > self.pool_bytes:
            return None
        try:
            data, handle = self.memory.allocate(nbytes)
        except Exception as exc:  # noqa: BLE001 - out of device memory, or sharing refused
            # Stop growing: retrying a cudaMalloc for every layer costs more than inline.
            log.warning("device slot of %d bytes not allocated (%s); pool capped at %d bytes",
                        nbytes, exc, owned)
            self.pool_bytes = owned
            return None
        slot = DeviceSlot(data, handle)
        self.slots.append(slot)
        return slot

    def release_through(self, seq: int) -> None:
        """The receiver is done with every send up to `seq`."""
        for slot in self.slots:
            if 0 <= slot.lent_seq <= seq:
                self._ticks += 1
                slot.lent_seq, slot.freed_at = -1, self._ticks

    @property
    def bytes_owned(self) -> int:
        return sum(s.size for s in self.slots)

    def check_integrity(self) -> None:
        lent = [s.lent_seq for s in self.slots if s.lent_seq >= 0]
        assert len(set(lent)) == len(lent), "two slots lent to one send"
        assert all(s <= self._seq for s in lent), "a slot lent to a send not yet made"
        assert self.bytes_owned <= self.pool_bytes, "pool over its cap"

    def close(self) -> None:
        self.slots.clear()  # torch keeps what a receiver still maps until it lets go


class ShmDeviceSender:
    """The sending half: probe on HELLO, then device slots for layers on this device."""

    def __init__(self, memory: IpcMemory, pool_bytes: int) -> None:
        self.memory = memory
        self.pool = DeviceSlotPool(memory, pool_bytes)
        self.peer_takes_ipc = False
        self._probe: torch.Tensor | None = None  # alive until the receiver answered

    def hello(self) -> Header | None:
        """The probe HELLO; None (no HELLO, host slots only) if it cannot be shared."""
        nonce = os.urandom(PROBE_BYTES)
        try:
            probe, handle = self.memory.allocate(PROBE_BYTES)
            probe.copy_(torch.tensor(list(nonce), dtype=torch.uint8))
            self.memory.fence()
        except Exception as exc:  # noqa: BLE001 - no IPC here: stage through host memory
            log.warning("CUDA IPC probe not shared (%s); same-node layers go through host memory",
                        exc)
            return None
        self._probe = probe
        return Header(HELLO, "", data_path=SHM, extra={**handle.to_extra(), PROBE: nonce.hex()})

    def takes(self, kv: torch.Tensor) -> bool:
        return self.peer_takes_ipc and self.memory.holds(kv)

    def payload(self, header: Header, kv: torch.Tensor) -> bool:
        """Copy `kv` into a device slot and name it in `header`; False if none is free."""
        slot = self.pool.lend(header.nbytes)
        if slot is None:
            return False
        # On this thread's current stream: the default stream, where the engine exported
        # `kv` too (it makes no other), so the copy follows the export.
        slot.data[: header.nbytes].copy_(kv.detach().reshape(-1).view(torch.uint8))
        # Synchronize here rather than hand the receiver an IPC event to wait on: the
        # header must not leave before the bytes land, and an event would cost the receiver
        # an open per layer while this channel thread has nothing else to do meanwhile.
        self.memory.fence()
        header.checksum = 0
        header.extra = {**slot.handle.to_extra(), SEQ: slot.lent_seq}
        return True

    def on_release(self, header: Header) -> bool:
        """Handle a RELEASE meant for this half; False if it is the host half's."""
        if not header.transfer_id and TAKES_IPC in header.extra:
            self.peer_takes_ipc = header.extra[TAKES_IPC] == 1
            self._probe = None
            return True
        seq = header.extra.get(SEQ)
        if isinstance(seq, int) and not isinstance(seq, bool):
            self.pool.release_through(seq)
            return True
        return False

    def close(self) -> None:
        self.pool.close()
        self._probe = None


class ShmDeviceReceiver:
    """The receiving half: answers the probe, maps slots (cached), copies out of them."""

    def __init__(self, memory: IpcMemory) -> None:
        self.memory = memory
        self._mappings: OrderedDict[IpcHandle, torch.Tensor] = OrderedDict()

    def answer_hello(self, header: Header) -> Header:
        return Header(RELEASE, "", extra={TAKES_IPC: int(self._probe_matches(header))})

    def _probe_matches(self, header: Header) -> bool:
        nonce = header.extra.get(PROBE)
        try:
            handle = IpcHandle.from_extra(header.extra)
            if not isinstance(nonce, str) or len(nonce) != 2 * PROBE_BYTES or handle.size < PROBE_BYTES:
                raise ValueError("malformed probe")
            got = bytes(self.memory.open(handle)[:PROBE_BYTES].cpu().tolist())
        except Exception as exc:  # noqa: BLE001 - any failure means: stage through host memory
            log.info("CUDA IPC probe from a sender failed (%s: %s); it will use host memory",
                     type(exc).__name__, exc)
            return False
        return got.hex() == nonce

    def read(self, header: Header, frames: list, shape: tuple[int, ...], reply: Reply) -> Received:
        tid, seq = header.transfer_id, header.extra.get(SEQ)
        try:
            handle = IpcHandle.from_extra(header.extra)
            if frames or not isinstance(seq, int) or isinstance(seq, bool) or seq < 0 \
                    or handle.size < header.nbytes:
                raise ValueError("the header does not describe a device slot")
        except ValueError as exc:
            raise TransferCorrupt(f"{tid!r}: bad CUDA IPC slot reference: {exc}", "malformed",
                                  tid) from None
        data = self._map(handle, tid)[: header.nbytes]

        def release() -> None:
            self.memory.fence()  # our copy out of the slot has landed: it may be rewritten
            reply(Header(RELEASE, tid, extra={SEQ: seq}))

        return Received(data.view(getattr(torch, header.dtype)).view(shape), None, release)

    def _map(self, handle: IpcHandle, tid: str) -> torch.Tensor:
        data = self._mappings.get(handle)
        if data is not None:
            self._mappings.move_to_end(handle)
            return data
        try:
            data = self.memory.open(handle)
        except Exception as exc:  # noqa: BLE001 - other node, GPU not visible, no CUDA
            raise TransferRejected(f"{tid!r}: CUDA IPC slot cannot be opened here "
                                   f"({type(exc).__name__}: {exc})", "cuda_ipc_open", tid) from None
        self._mappings[handle] = data
        while len(self._mappings) > MAX_DEVICE_MAPPINGS:
            self._mappings.popitem(last=False)
        return data

    def close(self) -> None:
        self._mappings.clear()
