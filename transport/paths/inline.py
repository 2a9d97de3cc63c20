"""The `inline` data path: a layer's bytes as ZMQ frames on the control connection, sent
straight from tensor memory. Every receiver accepts it; it is the fallback of every path.
"""

from __future__ import annotations

import torch

from transport.base import TransferCorrupt
from transport.paths.base import (
    Received,
    RecvPath,
    Reply,
    SendPath,
    tensor_from_bytes,
)
from transport.wire import INLINE, Header, payload_checksum
from workers.engine.kv_cache import tensor_bytes
from workers.engine.kv_types import FramedKV

# A layer goes out as frames of at most this many bytes. A received ZMQ message of 32 MiB
# or more lands in a fresh mmap every time (glibc never keeps chunks that big), paying a
# page fault per 4 KiB: 32 MiB layers moved at half the speed of 8 MiB ones.
INLINE_FRAME_BYTES = 8 << 20
MAX_INLINE_FRAMES = 4096  # a receiver bound: 32 GiB of 8 MiB frames


class InlineSendPath(SendPath):
    name = INLINE

    def payload(self, header: Header, kv: torch.Tensor, checksum: int | None = None) -> list:
        data = tensor_bytes(kv.detach().cpu().contiguous())
        header.checksum = payload_checksum(data) if checksum is None else checksum
        return [data[i:i + INLINE_FRAME_BYTES] for i in range(0, len(data), INLINE_FRAME_BYTES)] or [data]


class InlineRecvPath(RecvPath):
    name = INLINE

    def read(self, peer: bytes, header: Header, frames: list, shape: tuple[int, ...],
             reply: Reply) -> Received:
        bufs = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
        if not 1 <= len(bufs) <= MAX_INLINE_FRAMES or sum(b.nbytes for b in bufs) != header.nbytes:
            raise TransferCorrupt(f"{header.transfer_id!r}: payload frames do not match the "
                                  "header", "malformed", header.transfer_id)
        if len(bufs) == 1:
            return Received(tensor_from_bytes(bufs[0], header.dtype, shape), header.checksum)
        pieces = tuple(tensor_from_bytes(b, "uint8", (b.nbytes,)) for b in bufs)
        return Received(FramedKV(pieces, tuple(shape), getattr(torch, header.dtype)), header.checksum)
