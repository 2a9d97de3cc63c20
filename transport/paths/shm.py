"""The `shm` data path: same-node transfers through shared-memory files in /dev/shm.

The sender copies each layer into a reusable slot file (copy 1, hashing each piece while
it is in cache), sends the header over ZMQ naming the slot; the receiver maps the slot and
copies it into its blocks (copy 2, verifying the checksum the same way), then answers
RELEASE so the slot is reused. Two copies is the floor for a path where the
sender's tensor is not itself in shared memory. When every slot is in flight and the pool
is at its cap, the layer goes inline over ZMQ instead of waiting.

A CUDA layer goes GPU to GPU instead, through a device slot shared by CUDA IPC, when the
receiver's KV cache is on CUDA and it opened the sender's probe (`shm_cuda.py`); otherwise
it is staged through host memory here.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from transport.base import TransferCorrupt, TransferRejected
from transport.paths.base import (
    Received,
    RecvPath,
    Reply,
    SendPath,
    copy_and_checksum,
    copy_bytes,
    tensor_bytes,
    tensor_from_bytes,
)
from transport.paths.cuda_ipc import IpcMemory
from transport.paths.inline import InlineSendPath
from transport.paths.shm_cuda import TAKES_IPC, ShmDeviceReceiver, ShmDeviceSender, is_device_header
from transport.wire import RELEASE, SHM, Header

SHM_DIR = Path("/dev/shm")
# pdc-kv-<creator pid>-<random>: the pid lets a later sender remove the slots of a
# process that died without closing (a killed replica would otherwise leak /dev/shm).
_SLOT_NAME = re.compile(r"^pdc-kv-([0-9]{1,10})-[0-9a-f]{24}$")
MAX_MAPPINGS = 256


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, someone else's
    return True


def sweep_dead_slots(shm_dir: Path = SHM_DIR) -> int:
    """Unlink the slot files of senders that died without closing; returns how many.

    Only files whose creator pid no longer exists are touched. (Where /dev/shm is shared
    across pid namespaces a live sender may look dead; its receiver then fails to map a
    slot, the transfer fails and the request prefills locally: degraded, never corrupt.)"""
    removed = 0
    for path in shm_dir.glob("pdc-kv-*"):
        match = _SLOT_NAME.match(path.name)
        if match and not _pid_alive(int(match.group(1))):
            try:
                path.unlink()
                removed += 1
            except (FileNotFoundError, PermissionError):
                pass
    return removed


@dataclass
class _Slot:
    name: str
    size: int
    data: torch.Tensor  # uint8 view of the whole shared file
    transfer_id: str = ""  # in flight for this transfer; "" = free
    freed_at: int = 0  # release tick: the latest-freed slot is the likeliest still in cache


_swept = threading.Event()


def _sweep_once() -> None:
    """Once per process, when it first sends over shm (a path is made per transfer)."""
    if not _swept.is_set():
        _swept.set()
        sweep_dead_slots()


class ShmSendPath(SendPath):
    name = SHM

    def __init__(self, pool_bytes: int, ipc: IpcMemory | None = None) -> None:
        self.pool_bytes = pool_bytes
        self._slots: dict[str, _Slot] = {}
        self._ticks = 0
        _sweep_once()
        self._inline = InlineSendPath()
        # ipc: this process's device memory (None off CUDA: host slots only, no HELLO)
        self._device = ShmDeviceSender(ipc, pool_bytes) if ipc is not None else None

    def hello(self) -> Header | None:
        return self._device.hello() if self._device is not None else None

    def payload(self, header: Header, kv: torch.Tensor, checksum: int | None = None) -> list:
        if self._device is not None and self._device.takes(kv):
            if self._device.payload(header, kv):
                return []
            header.data_path = self._inline.name  # device pool full: as for host slots
            return self._inline.payload(header, kv, checksum)
        slot = self._acquire(header.nbytes)
        if slot is None:  # pool full: do not block the channel, send this one inline
            header.data_path = self._inline.name
            return self._inline.payload(header, kv, checksum)
        slot.transfer_id = header.transfer_id
        dst, src = slot.data[: header.nbytes], kv.detach().cpu().contiguous()
        if checksum is None:
            header.checksum = copy_and_checksum(dst, src)
        else:
            copy_bytes(dst, src)
            header.checksum = checksum
        header.extra = {"file": slot.name, "size": slot.size}
        return []

    def _acquire(self, nbytes: int) -> _Slot | None:
        free = [s for s in self._slots.values() if not s.transfer_id and s.size >= nbytes]
        if free:  # the smallest that fits, the most recently freed among those
            return min(free, key=lambda s: (s.size, -s.freed_at))
        used = sum(s.size for s in self._slots.values())
        if used + nbytes > self.pool_bytes:
            return None
        name = f"pdc-kv-{os.getpid()}-{os.urandom(12).hex()}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        data = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        slot = _Slot(name, nbytes, data)
        self._slots[name] = slot
        return slot

    def on_release(self, header: Header) -> None:
        if self._device is not None and self._device.on_release(header):
            return
        slot = self._slots.get(str(header.extra.get("file", "")))
        if slot is not None and slot.transfer_id == header.transfer_id:
            self._free(slot)

    def on_transfer_end(self, transfer_id: str) -> None:
        for slot in self._slots.values():
            if slot.transfer_id == transfer_id:
                self._free(slot)

    def _free(self, slot: _Slot) -> None:
        self._ticks += 1
        slot.transfer_id, slot.freed_at = "", self._ticks

    def close(self) -> None:
        if self._device is not None:
            self._device.close()
        for slot in self._slots.values():
            try:
                (SHM_DIR / slot.name).unlink()
            except FileNotFoundError:
                pass
        self._slots.clear()


class ShmRecvPath(RecvPath):
    name = SHM

    def __init__(self, ipc: IpcMemory | None = None) -> None:
        self._mappings: OrderedDict[str, torch.Tensor] = OrderedDict()
        # ipc: device memory of this process's KV cache (None: it is in host memory)
        self._device = ShmDeviceReceiver(ipc) if ipc is not None else None

    def on_hello(self, peer: bytes, header: Header, reply: Reply) -> None:
        """A sender on CUDA probes whether its device slots can be opened here."""
        if self._device is None:
            reply(Header(RELEASE, "", extra={TAKES_IPC: 0}))
        else:
            reply(self._device.answer_hello(header))

    def read(self, peer: bytes, header: Header, frames: list, shape: tuple[int, ...],
             reply: Reply) -> Received:
        tid = header.transfer_id
        if is_device_header(header):
            if self._device is None:
                raise TransferRejected(f"{tid!r}: this receiver's KV cache is not on CUDA",
                                       "cuda_ipc_unsupported", tid)
            return self._device.read(header, frames, shape, reply)
        name, size = header.extra.get("file"), header.extra.get("size")
        if frames or not isinstance(name, str) or not _SLOT_NAME.match(name) \
                or not isinstance(size, int) or size < header.nbytes:
            raise TransferCorrupt(f"{tid!r}: bad shared-memory slot reference", "malformed", tid)
        data = self._map(name, size, tid)[: header.nbytes]

        def release() -> None:
            reply(Header(RELEASE, tid, extra={"file": name}))

        return Received(tensor_from_bytes(tensor_bytes(data), header.dtype, shape), header.checksum,
                        release)

    def _map(self, name: str, size: int, tid: str) -> torch.Tensor:
        data = self._mappings.get(name)
        if data is not None and data.numel() == size:
            self._mappings.move_to_end(name)
            return data
        path = SHM_DIR / name
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise TransferRejected(f"{tid!r}: slot {name} does not exist (other node?)",
                                   "shm_missing", tid) from None
        if actual != size:  # mapping past the end of a file would SIGBUS
            raise TransferCorrupt(f"{tid!r}: slot {name} has {actual} bytes, not {size}",
                                  "malformed", tid)
        data = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self._mappings[name] = data
        while len(self._mappings) > MAX_MAPPINGS:
            self._mappings.popitem(last=False)
        return data

    def close(self) -> None:
        self._mappings.clear()
        if self._device is not None:
            self._device.close()
