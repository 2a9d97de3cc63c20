"""The whole seam between the engine and a KV transport: every type and call that
crosses it, in one file.

One transfer moves one request's prompt KV, layer by layer, from a prefill engine into
blocks a decode engine reserved for it, then the decode engine continues the request as
if it had prefilled it itself (same tokens, same text).

Prefill side (the engine calls a `KVSink` the transport made):
    LLMEngine.add_request(..., kv_sink=sink)   prefill worker, with `KVSender.open(...)`'s sink
    sink.start_block                           engine: blocks before it are not exported
    sink.new_digest()                          engine, per layer: the checksum to feed while copying
    sink.export_buffer(nbytes)                 engine, per layer: a host buffer to copy into, or None
    sink.on_layer(layer_idx, kv, checksum)     engine's step thread, as soon as a layer is written
    sink.on_complete(first_token_id, logprob, siblings)
                                               engine, when the prompt's first token is sampled
                                               (`logprob`: its TokenLogprob, None unless asked;
                                               `siblings`: with n > 1, sequences 1..'s first tokens)
    sink.on_abort(reason)                      engine, when the request ends before that

Decode side (a receiver writes into a `KVTarget`: `LLMEngine`, the thread-safe
`AsyncEngine` the workers pass to receivers, or `transport.memory_target.MemoryTarget`):
    LLMEngine.reserve_kv(transfer_id, prompt_token_ids) -> KVReservation | None
                                               decode worker, before asking a prefill replica
    target.layout                              receiver: what incoming headers must match
    target.write_kv_layer(res, layer_idx, kv, digest)
                                               receiver's threads, once per layer; `kv` is a
                                               tensor, a `FramedKV` or a `StreamedKV`
    target.cancel_kv(res)                      receiver on any failure, decode worker on its own
    receiver's result: FirstToken(token_id, logprob, siblings), what the sink's on_complete got
    LLMEngine.commit_kv(res, request_id, params, first_token_id, seed=..., first_logprob=...,
                        siblings=...)                 (siblings: n > 1, the request forks there)
                                               decode worker, with the first token the
                                               receiver got with the last layer; that token
                                               is the request's first output (its text from
                                               the request's own detokenizer and stop rules,
                                               its logprob the prefill engine's)

Block math: `num_blocks(num_tokens, block_size)` (or `KVLayout.num_blocks`) is how many
blocks hold `num_tokens` tokens, everywhere.

Layer tensors have shape `KVLayout.layer_shape(num_blocks)`:
`[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`, contiguous.

Importing this file does not import torch (the router uses `num_blocks`): torch is
imported where a method needs it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeAlias

if TYPE_CHECKING:
    import torch

    from workers.engine.sequence import TokenLogprob


def num_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens (the last one may be partly filled)."""
    return -(-num_tokens // block_size)


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

    def num_blocks(self, num_tokens: int) -> int:
        return num_blocks(num_tokens, self.block_size)

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def layer_nbytes(self, num_blocks: int) -> int:
        import torch

        return math.prod(self.layer_shape(num_blocks)) * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class FirstToken:
    """What a completed transfer resolves to: the token the prefill engine sampled from the
    prompt's last logits, and its logprob when the request asked for logprobs."""

    token_id: int
    logprob: TokenLogprob | None = None
    # With n > 1: the first tokens of the request's sequences 1, 2, ... (seeds seed + i),
    # sampled from the same logits; the receiving engine forks the request into them.
    siblings: tuple[FirstToken, ...] = ()


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


class ByteDigest(Protocol):
    """What a layer's copy into (or out of) the blocks feeds its bytes to, in the payload's
    byte order (an `xxhash.xxh3_64`: the transport's checksum, made or verified while copying)."""

    def update(self, data: memoryview, /) -> None: ...

    def intdigest(self) -> int: ...


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

    def on_complete(self, first_token_id: int, logprob: TokenLogprob | None = None,
                    siblings: tuple[FirstToken, ...] = ()) -> None:
        """All layers were handed over; `first_token_id` is the token prefill sampled and
        `logprob` its log-probability (None unless the request asked for logprobs);
        `siblings` the other sequences' first tokens when the request has n > 1. The
        transport delivers them with the last layer: they are what the decode side commits."""

    def on_abort(self, reason: str) -> None:
        """The request ended before its KV was complete (abort, error, preemption)."""


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
class FramedKV:
    """One layer's received payload in the pieces it arrived in (CPU byte tensors whose
    concatenation is the layer's bytes): `copy_into_blocks` copies from them in order,
    so a layer sent as several frames is never joined into one buffer first."""

    pieces: tuple[torch.Tensor, ...]  # contiguous uint8, CPU
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        nbytes = sum(p.numel() for p in self.pieces)
        if nbytes != math.prod(self.shape) * self.dtype.itemsize:
            raise ValueError(f"{nbytes} bytes of pieces do not make a {self.dtype} tensor of {self.shape}")

    def joined(self) -> torch.Tensor:
        """The layer as one tensor (one extra copy: only for a destination that is not host memory)."""
        import torch

        return torch.cat([p.reshape(-1) for p in self.pieces]).view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class StreamedKV:
    """One layer's payload still arriving on a `ByteStream`: `copy_into_blocks` reads it
    straight into the destination blocks, so the kernel's copy out of the socket is the
    only one on the receive side (a ZMQ message would land in libzmq's memory first)."""

    stream: ByteStream
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def joined(self) -> torch.Tensor:
        """The layer read into one host tensor: only for a destination that is not host memory."""
        import torch

        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        self.stream.fill(memoryview(buf.numpy()))
        return buf.view(self.dtype).view(self.shape)


# One received layer as `KVTarget.write_kv_layer` takes it (a host payload or any tensor).
KVPayload: TypeAlias = "torch.Tensor | FramedKV | StreamedKV"


class KVTarget(Protocol):
    """What a receiver writes into: the decode engine (`LLMEngine`, or `AsyncEngine` in a
    worker) or a test double (`transport.memory_target.MemoryTarget`).

    `write_kv_layer` copies `kv` (shape `layout.layer_shape(res.num_blocks_to_receive)`)
    into the reserved blocks `[num_cached_blocks:]`, feeding `digest` (if given) every
    byte of `kv` in order, so the receiver verifies the payload's checksum in the same
    pass (`copy_into_blocks`); it is called from transport threads and must be
    thread-safe with the engine's step. `cancel_kv` frees the reservation; idempotent.
    """

    @property
    def layout(self) -> KVLayout: ...

    def write_kv_layer(self, res: KVReservation, layer_idx: int, kv: KVPayload,
                       digest: ByteDigest | None = None) -> None: ...

    def cancel_kv(self, res: KVReservation) -> None: ...
