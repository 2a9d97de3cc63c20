"""CUDA IPC: naming a piece of GPU memory to another process on the same node.

The mechanics under the `shm` data path's device half (`shm_cuda.py`). A sender shares a
device buffer once, when it allocates it (`IpcMemory.allocate`); the `IpcHandle` it gets
back is plain bytes and ints, so it travels inside the authenticated msgpack header and is
never pickled. (The bytes go hex-encoded in a string: a header's `extra` carries only str
and int, and the parser refuses msgpack bin outright.) A receiver `open`s the handle into
a tensor over the same memory, mapped on its own device: CUDA enables peer access when
the memory lives on another GPU of this node, and fails when that GPU is not visible.

`IpcMemory` is the seam, so the bookkeeping above it runs in CPU tests with a stand-in;
`CudaIpcMemory` is the real thing, on the storage-sharing primitives that
`torch.multiprocessing.reductions` itself uses to pickle a CUDA tensor:

- `UntypedStorage._share_cuda_()` -> `(device, handle, size_bytes, offset_bytes,
  ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)`
- `UntypedStorage._new_shared_cuda(device, handle, size_bytes, offset_bytes,
  ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)`

Lifetime: `_share_cuda_` puts the storage behind torch's IPC reference counter, so the
sender's allocator holds the memory back ("limbo") until every receiver that opened it has
dropped its mapping, even when the sender frees its tensor first: a receiver never reads
memory the sender's allocator handed to something else. torch's own IPC event is recorded
once, at share time, so it says nothing about later writes into a reused buffer; we pass
`event_sync_required=False` and the data path orders those writes itself (`shm_cuda.py`).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

# Hex-encoded, a handle must fit one header string (`WireLimits.max_str_len`, 4096). torch's
# handle for a cudaMalloc'd block is 66 bytes; an expandable segment's grows with its size.
MAX_HANDLE_BYTES = 2048
MAX_IPC_BYTES = 1 << 40
MAX_REF_COUNTER_OFFSET = 1 << 20  # torch's counter files hold 10,000 counters
_HEX = re.compile(r"^(?:[0-9a-f]{2})+$")
# torch names its counter files "/torch_<pid>_<id>..." in /dev/shm; one path component only.
_REF_COUNTER_NAME = re.compile(r"^/[A-Za-z0-9_.-]{1,200}$")
_NO_EVENT = bytes(64)  # sizeof(cudaIpcEventHandle_t); never read with event_sync_required=False
_KEYS = ("ipc", "ipc_offset", "ipc_size", "ipc_ref", "ipc_ref_offset")


def _is_int(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


@dataclass(frozen=True)
class IpcHandle:
    """What a receiver needs to map one shared device buffer (hashable: the receiver's
    cache key for the mapping)."""

    handle: bytes  # torch's shareable handle for the allocation the buffer lies in
    offset: int  # bytes from the start of that allocation to the buffer
    size: int  # bytes of the buffer
    ref_counter: str = ""  # torch's IPC reference-counter file, and the counter in it
    ref_counter_offset: int = 0

    def to_extra(self) -> dict[str, str | int]:
        return dict(zip(_KEYS, (self.handle.hex(), self.offset, self.size, self.ref_counter,
                                self.ref_counter_offset), strict=True))

    @classmethod
    def from_extra(cls, extra: dict) -> IpcHandle:
        """The handle a header's `extra` names; ValueError saying what is wrong with it."""
        handle, offset, size, ref_counter, ref_offset = (extra.get(k) for k in _KEYS)
        if not isinstance(handle, str) or not 0 < len(handle) <= 2 * MAX_HANDLE_BYTES \
                or not _HEX.match(handle):
            raise ValueError("the IPC handle is not hex of at most "
                             f"{MAX_HANDLE_BYTES} bytes")
        if not (_is_int(offset, 0, MAX_IPC_BYTES) and _is_int(size, 1, MAX_IPC_BYTES)):
            raise ValueError("the IPC buffer's offset or size is out of range")
        if not isinstance(ref_counter, str) or not _REF_COUNTER_NAME.match(ref_counter) \
                or not _is_int(ref_offset, 0, MAX_REF_COUNTER_OFFSET):
            raise ValueError("the IPC reference counter is malformed")
        return cls(bytes.fromhex(handle), offset, size, ref_counter, ref_offset)


class IpcMemory(ABC):
    """Device memory one process can name to another on this node.

    Contract: `allocate` returns a contiguous uint8 buffer of exactly `nbytes` and its
    handle; `open(handle)` in another process returns a uint8 tensor over the same bytes,
    or raises (any exception: the caller turns it into a clean transfer failure); `fence`
    returns once every copy this thread queued on the device has landed."""

    @abstractmethod
    def holds(self, kv: torch.Tensor) -> bool:
        """Whether `kv` lives in this memory, so it can be copied into a buffer of it."""

    @abstractmethod
    def allocate(self, nbytes: int) -> tuple[torch.Tensor, IpcHandle]: ...

    @abstractmethod
    def open(self, handle: IpcHandle) -> torch.Tensor: ...

    @abstractmethod
    def fence(self) -> None: ...


class CudaIpcMemory(IpcMemory):
    """This process's CUDA device (the current one, where the engine's KV cache is)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._device = device

    @property
    def device(self) -> torch.device:
        # Resolved on first use, not at construction: asking initializes CUDA.
        if self._device is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        return self._device

    def holds(self, kv: torch.Tensor) -> bool:
        return kv.is_cuda and kv.device == self.device

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, IpcHandle]:
        data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        _, handle, size, offset, ref_counter, ref_offset, _, _ = data.untyped_storage()._share_cuda_()
        if len(handle) > MAX_HANDLE_BYTES:  # a receiver would refuse it: keep to host memory
            raise ValueError(f"CUDA IPC handle of {len(handle)} bytes exceeds {MAX_HANDLE_BYTES}")
        return data, IpcHandle(handle, offset, size, ref_counter.decode("ascii"), ref_offset)

    def open(self, handle: IpcHandle) -> torch.Tensor:
        torch.cuda.init()
        storage = torch.UntypedStorage._new_shared_cuda(
            self.device.index, handle.handle, handle.size, handle.offset,
            handle.ref_counter.encode("ascii"), handle.ref_counter_offset, _NO_EVENT, False)
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(
            storage, 0, (handle.size,), (1,))

    def fence(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


def cuda_ipc_for(device: str) -> IpcMemory | None:
    """The IPC memory for a process whose engine runs on `device`; None off CUDA."""
    return CudaIpcMemory() if device == "cuda" else None
