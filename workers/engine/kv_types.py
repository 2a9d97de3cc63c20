"""The seam between the engine and a KV transport.

Prefill side: a request added with a `KVSink` has its prompt KV handed to the sink one
layer at a time, as soon as the step that completes the prompt has written that layer.
Decode side: `LLMEngine.reserve_kv` allocates blocks for an expected transfer (reusing
blocks its prefix cache already holds), the transport writes each received layer with
`LLMEngine.write_kv_layer`, then `commit_kv` turns the reservation into a running
request, or `cancel_kv` frees it.

Layer tensors have shape `KVLayout.layer_shape(num_blocks)`:
`[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`, contiguous.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class KVLayout:
    """Everything that must match for KV computed by one engine to be valid in another."""

    model_fingerprint: str  # hash of the model config (architecture, sizes, rope)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "bfloat16"

    def fingerprint(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=16).hexdigest()

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def layer_nbytes(self, num_blocks: int) -> int:
        n = 1
        for d in self.layer_shape(num_blocks):
            n *= d
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


class KVSink(Protocol):
    """Receives a request's prompt KV from the prefill engine, layer by layer.

    Called on the engine's step thread; implementations must return quickly (hand the
    tensor to a sender thread). `kv` is a contiguous tensor owned by the sink: fresh, or a
    view of the buffer the sink lent for it with `export_buffer`.
    Blocks before `start_block` are not sent (the receiver already caches them).
    """

    start_block: int

    def new_digest(self) -> ByteDigest | None:
        """A fresh digest of the transport's payload checksum, for the engine to feed a
        layer's bytes while it copies them out of the blocks; None if the sink wants none."""

    def export_buffer(self, nbytes: int) -> torch.Tensor | None:
        """A contiguous uint8 host buffer of exactly `nbytes` for the engine to copy the
        next layer into, or None for a fresh tensor. The engine then passes a view of it as
        that layer's `on_layer` `kv` and never touches it again: the sink reuses it once
        its transport no longer reads it. Asked only for a cache in host memory."""

    def on_layer(self, layer_idx: int, kv: torch.Tensor, checksum: int | None = None) -> None:
        """`checksum`: the `new_digest()` result over `kv`'s bytes, when the engine made one."""

    def on_complete(self, first_token_id: int) -> None:
        """All layers were handed over; `first_token_id` is the token prefill sampled."""

    def on_abort(self, reason: str) -> None:
        """The request ended before its KV was complete (abort, error, preemption)."""


class ByteDigest(Protocol):
    """What a layer's copy into (or out of) the blocks feeds its bytes to, in the payload's
    byte order (an `xxhash.xxh3_64`: the transport's checksum, made or verified while copying)."""

    def update(self, data: memoryview, /) -> None: ...

    def intdigest(self) -> int: ...


@dataclass(frozen=True)
class FramedKV:
    """One layer's received payload in the pieces it arrived in (CPU byte tensors whose
    concatenation is the layer's bytes): `copy_into_blocks` copies from them in order,
    so a layer sent as several frames is never joined into one buffer first."""

    pieces: tuple[torch.Tensor, ...]  # contiguous uint8, CPU
    shape: tuple[int, ...]
    dtype: torch.dtype
    device = torch.device("cpu")

    def __post_init__(self) -> None:
        nbytes = sum(p.numel() for p in self.pieces)
        numel = 1
        for d in self.shape:
            numel *= d
        if nbytes != numel * torch.empty((), dtype=self.dtype).element_size():
            raise ValueError(f"{nbytes} bytes of pieces do not make a {self.dtype} tensor of {self.shape}")

    def joined(self) -> torch.Tensor:
        """The layer as one tensor (one extra copy: only for a destination that is not host memory)."""
        return torch.cat([p.reshape(-1) for p in self.pieces]).view(self.dtype).view(self.shape)


class ByteStream(Protocol):
    """Bytes that arrive in order, read once (a transport's data connection)."""

    def fill(self, view: memoryview) -> None:
        """Read exactly `len(view)` bytes into `view`, or raise."""
        ...

    def stop_when(self, stop: Callable[[], bool]) -> None:
        """The transport's hook: `fill` gives up (raises) while the sender is silent and
        `stop()` is true, e.g. once the transfer failed elsewhere."""
        ...


@dataclass(frozen=True)
class StreamedKV:
    """One layer's payload still arriving on a `ByteStream`: `copy_into_blocks` reads it
    straight into the destination blocks, so the kernel's copy out of the socket is the
    only one on the receive side (a ZMQ message would land in libzmq's memory first)."""

    stream: ByteStream
    shape: tuple[int, ...]
    dtype: torch.dtype
    device = torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def joined(self) -> torch.Tensor:
        """The layer read into one host tensor: only for a destination that is not host memory."""
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        self.stream.fill(memoryview(buf.numpy()))
        return buf.view(self.dtype).view(self.shape)


@dataclass
class KVReservation:
    """Blocks held on the decode side for one expected transfer."""

    transfer_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]  # one per block of the prompt, in order
    num_cached_blocks: int  # leading blocks already valid from the prefix cache
    layout: KVLayout
    layers_written: set[int] = field(default_factory=set)

    @property
    def num_blocks_to_receive(self) -> int:
        return len(self.block_ids) - self.num_cached_blocks


@dataclass(frozen=True)
class StepRecord:
    """One engine step, for the `auto` policy and the `plan` simulator to learn from."""

    start_time: float  # time.time() at step start
    step_time_s: float
    num_prefill_tokens: int  # prompt tokens computed this step
    num_decode_seqs: int  # sequences that produced a decode token this step
    num_context_tokens: int  # sum of context lengths attended over
    num_running: int
    num_waiting: int
