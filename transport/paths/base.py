"""Data paths: how one LAYER message's bytes travel once its header is on the ZMQ socket.

The control plane (headers, acks) is always ZMQ; a data path moves the payload. Each has a
sending half (one per peer connection, used only by that connection's thread) and a
receiving half (one per receiver, used by the thread that handles that peer).
`inline` (this file) sends the bytes as ZMQ frames straight from tensor memory.
"""

from __future__ import annotations

import ctypes
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from transport.base import TransferCorrupt, new_payload_digest
from transport.wire import Header
from workers.engine.kv_cache import memmove_hashed, tensor_bytes
from workers.engine.kv_types import FramedKV

Reply = Callable[[Header], None]  # send a control message back to the peer


def _byte_size(dst: torch.Tensor, src: torch.Tensor) -> int:
    """Bytes to copy; raises unless both are contiguous CPU tensors of that size (a memmove
    must never overrun)."""
    nbytes = src.numel() * src.element_size()
    if not (src.is_contiguous() and dst.is_contiguous() and src.device.type == "cpu"
            and dst.device.type == "cpu" and dst.numel() * dst.element_size() == nbytes):
        raise ValueError("byte copies need contiguous CPU tensors of equal byte size")
    return nbytes


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """memcpy between contiguous CPU tensors of equal byte size, on the calling thread.

    Not `Tensor.copy_`: that splits big copies across torch's intra-op thread pool, and
    on a busy node the OpenMP barrier waits for a descheduled worker (a 128 KiB layer
    was measured taking 100 ms). ctypes releases the GIL during the copy."""
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), _byte_size(dst, src))


def copy_and_checksum(dst: torch.Tensor, src: torch.Tensor, chunk: int | None = None) -> int:
    """`copy_bytes`, returning the `payload_checksum` of the bytes. Each piece is hashed
    right after it is copied, while it is still in cache, rather than re-read from memory
    in a second pass (the receiver's `copy_into_blocks` does the same)."""
    digest = new_payload_digest()
    memmove_hashed(dst.data_ptr(), 0, src.data_ptr(), _byte_size(dst, src), tensor_bytes(dst), digest,
                   chunk)
    return digest.intdigest()


def tensor_from_bytes(buf: memoryview | bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero-copy tensor over received bytes; read-only use (it is copied into blocks)."""
    with warnings.catch_warnings():  # the buffer is read-only; we never write through it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).view(shape)


class SendPath(ABC):
    """Sending half. Called only from the owning peer connection's thread."""

    name: str

    def hello(self) -> Header | None:
        """A handshake message to send before the first LAYER, or None."""
        return None

    @abstractmethod
    def payload(self, header: Header, kv: torch.Tensor, checksum: int | None = None) -> list:
        """Fill `header.checksum`/`extra`; return frames to send after the header.
        `checksum` is the payload's, when the engine made it while exporting the layer."""

    def after_send(self, header: Header, kv: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Runs once the header is queued (out-of-band sends happen here)."""

    def on_release(self, header: Header) -> None:  # noqa: B027 - optional hook
        """The receiver is done with a payload's resources."""

    def on_transfer_end(self, transfer_id: str) -> None:  # noqa: B027 - optional hook
        """A transfer resolved; free anything it still holds."""

    def close(self) -> None:  # noqa: B027 - optional hook
        return None


def _noop() -> None:
    return None


@dataclass
class Received:
    """A payload `RecvPath.read` handed over, to be copied into the reserved blocks."""

    kv: torch.Tensor | FramedKV  # FramedKV: a layer that came as several frames
    # The header's checksum, when the bytes are still to be verified: the receiver checks
    # it while copying them into the blocks (one memory pass) and discards the blocks on a
    # mismatch. None when there is nothing to verify here (a GPU tensor).
    checksum: int | None
    release: Callable[[], None] = _noop  # run once the copy is done, even if it failed


class RecvPath(ABC):
    """Receiving half. `read` returns the payload, unverified (see `Received`)."""

    name: str
    # True when `read` blocks (waits on another channel), so the receiver must call it
    # from a per-peer worker thread rather than its socket thread.
    blocking: bool = False

    @abstractmethod
    def read(self, peer: bytes, header: Header, frames: list, shape: tuple[int, ...],
             reply: Reply) -> Received: ...

    def on_hello(self, peer: bytes, header: Header, reply: Reply) -> None:
        raise TransferCorrupt(f"{self.name} path has no handshake", "malformed")

    def address_fields(self) -> dict[str, int]:
        """`PeerAddress` fields this path advertises (e.g. a data port)."""
        return {}

    def reap(self) -> list[bytes]:
        """Peers this path saw go away since the last call (their state is dropped)."""
        return []

    def discard(self, peer: bytes, header: Header, max_bytes: int) -> None:  # noqa: B027 - optional hook
        """Drop the payload of a layer that was refused before `read` (frames that came
        with the header, or a slot the sender reclaims, need nothing)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        return None
