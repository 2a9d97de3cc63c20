"""The KV transport contract: a sender on the prefill side, a receiver on the decode side.

One transfer moves one request's prompt KV, layer by layer, from a prefill engine into
blocks a decode engine reserved for it. It is keyed by a `transfer_id` the router chose
(from the request's `x-request-id` plus a nonce), never by an engine-local id, so both
sides always agree on which transfer a message belongs to.

The flow the cluster runs:

    D: res = engine.reserve_kv(transfer_id, prompt_token_ids)
    D: receiver.expect(transfer_id, res, timeout)       -> router gets receiver.address
    P: sink = sender.open(transfer_id, address, engine.layout, start_block=res.num_cached_blocks)
    P: engine.add_request(..., kv_sink=sink)             # engine calls sink.on_layer/on_complete
    D: first = await receiver.wait_async(transfer_id)    # a FirstToken, or raises TransferError
    D: engine.commit_kv(res, ...)                        # on success; on error the receiver
                                                         # has already cancelled `res`

The engine's side of the seam (`KVSink`, `KVTarget`, the payload types) is in
`workers/engine/kv_types.py`.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import ClassVar

import torch
import xxhash

from transport.transfer_record import MAX_TRANSFER_RECORDS, TransferRecord
from workers.engine.kv_types import ByteDigest, FirstToken, KVLayout, KVReservation
from workers.engine.sequence import TokenLogprob


def new_payload_digest() -> ByteDigest:
    """The payload checksum every path uses: xxh3-64, fast (~25 GB/s here) and
    non-cryptographic; its integrity comes from the MAC over the header that carries it."""
    return xxhash.xxh3_64()


class TransferError(Exception):
    """A transfer failed. `kind` names the class on the wire and in metrics; `reason`
    is the finer cause (e.g. "fingerprint" for a rejection)."""

    kind: ClassVar[str] = "error"

    def __init__(self, message: str, reason: str | None = None, transfer_id: str = "") -> None:
        super().__init__(message)
        self.reason = reason or self.kind
        self.transfer_id = transfer_id


class TransferTimeout(TransferError):
    """No completion within the configured time (peer silent, dead, or unreachable)."""

    kind = "timeout"


class TransferAuthError(TransferError):
    """A header's MAC did not verify: the peer does not hold our key, or it was tampered."""

    kind = "auth"


class TransferCorrupt(TransferError):
    """A payload did not match the checksum in its authenticated header, or was malformed."""

    kind = "corrupt"


class TransferRejected(TransferError):
    """A well-formed message the receiver will not accept: unknown or replayed transfer id,
    wrong fingerprint, protocol version or dtype, shapes beyond the receiver's bounds."""

    kind = "rejected"


class TransferAborted(TransferError):
    """The other side gave up on purpose (prefill aborted, decode cancelled, shutdown)."""

    kind = "aborted"


class PeerGone(TransferError):
    """The connection to the peer was lost mid-transfer."""

    kind = "peer_gone"


ERROR_KINDS: dict[str, type[TransferError]] = {
    cls.kind: cls
    for cls in (TransferError, TransferTimeout, TransferAuthError, TransferCorrupt,
                TransferRejected, TransferAborted, PeerGone)
}


def error_from_wire(kind: str, message: str, reason: str, transfer_id: str) -> TransferError:
    """Rebuild an error the peer reported; unknown kinds become the base class."""
    return ERROR_KINDS.get(kind, TransferError)(message, reason, transfer_id)


class KVReceiver(ABC):
    """Decode side. Accepts only transfers announced with `expect`, from authenticated peers.

    Contract:
    - `expect` registers a reservation; if the transfer is not complete within `timeout`
      (default: the configured reservation TTL) it fails with `TransferTimeout`.
    - Whenever a transfer fails for any reason the receiver calls `cancel_kv(res)` on its
      `KVTarget` exactly once, before `wait` raises; the caller must not cancel it again.
    - When `wait` returns the first token id, every layer has been written, and the caller
      owns the reservation (commit it, or cancel it through the engine).
    - Bad messages are rejected and counted in `metrics`; they never stop the receiver.
    """

    backend: ClassVar[str]

    @property
    @abstractmethod
    def address(self) -> str:
        """Advertised address the router hands to prefill senders (never a guessed localhost)."""

    @abstractmethod
    def expect(self, transfer_id: str, reservation: KVReservation,
               timeout: float | None = None) -> None:
        """Announce a transfer; raises `ValueError` if the id is pending or recently used."""

    @abstractmethod
    def future(self, transfer_id: str) -> Future[FirstToken]:
        """The transfer's result: the first token (with its logprob), or a `TransferError`."""

    def wait(self, transfer_id: str, timeout: float | None = None) -> FirstToken:
        """Block until the transfer completes; returns the first token.

        A `timeout` shorter than the reservation's fails the transfer when it elapses."""
        fut = self.future(transfer_id)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            self.cancel(transfer_id, TransferTimeout(
                f"transfer {transfer_id} not complete within {timeout}s", transfer_id=transfer_id))
            return fut.result(0)

    async def wait_async(self, transfer_id: str, timeout: float | None = None) -> FirstToken:
        """`wait` for asyncio callers; no thread is held while waiting."""
        fut = asyncio.wrap_future(self.future(transfer_id))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            self.cancel(transfer_id, TransferTimeout(
                f"transfer {transfer_id} not complete within {timeout}s", transfer_id=transfer_id))
            return await fut

    @abstractmethod
    def cancel(self, transfer_id: str, error: TransferError | None = None) -> None:
        """Fail a pending transfer (cancelling its reservation); no-op if already finished."""

    @abstractmethod
    def pending_ids(self) -> list[str]:
        """Transfers expected and not yet finished."""

    @abstractmethod
    def close(self) -> None:
        """Fail every pending transfer with `TransferAborted` and release sockets/threads."""


class SenderSink(ABC):
    """A `KVSink` for one transfer, plus a way to learn how it ended.

    Engine-facing methods return at once (work is queued to a sender thread). The result
    resolves to None when the receiver acknowledged every layer, or to a `TransferError`.
    """

    data_path: str = "none"  # set by subclasses: the path its layers travel

    def __init__(self, transfer_id: str, layout: KVLayout, start_block: int) -> None:
        self.transfer_id = transfer_id
        self.layout = layout
        self.start_block = start_block
        self.result: Future[None] = Future()
        # a completed transfer's record goes here (set by the sender that opened the sink)
        self.on_record: Callable[[TransferRecord], None] | None = None
        self.peer = ""  # the receiver's address, for the record (set by the sender with on_record)
        self._num_bytes = self._num_layers = 0
        self._start_time = self._first_layer_at = self._last_layer_at = 0.0
        # once acknowledged: from the last layer handed to the acknowledgement (the record's
        # `tail_seconds`); None before, or when no layer was sent
        self.tail_seconds: float | None = None

    def layer_handed(self, kv: torch.Tensor) -> None:
        """Subclasses call this from `on_layer`, before queueing the layer: the record's
        clock and size."""
        now = time.perf_counter()
        if not self._num_layers:
            self._start_time, self._first_layer_at = time.time(), now
        self._last_layer_at = now
        self._num_layers += 1
        self._num_bytes += kv.numel() * kv.element_size()

    def new_digest(self) -> ByteDigest | None:
        """The payload checksum's digest (`wire.payload_checksum`), for the engine to feed
        while it exports a layer, so the sender does not read the layer a second time."""
        return new_payload_digest()

    def export_buffer(self, nbytes: int) -> torch.Tensor | None:
        """None: the engine exports into a fresh tensor. A sink whose sender knows when
        its sends are done lends a reusable buffer instead (`ChannelSink`)."""
        return None

    @abstractmethod
    def on_layer(self, layer_idx: int, kv: torch.Tensor, checksum: int | None = None) -> None: ...

    @abstractmethod
    def on_complete(self, first_token_id: int, logprob: TokenLogprob | None = None) -> None: ...

    @abstractmethod
    def on_abort(self, reason: str) -> None: ...

    @property
    def done(self) -> bool:
        return self.result.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until acknowledged; raises the `TransferError` if it failed."""
        self.result.result(timeout)

    async def wait_async(self) -> None:
        await asyncio.wrap_future(self.result)

    def fail(self, error: TransferError) -> bool:
        """Resolve with `error` unless already resolved; True if this call resolved it."""
        if self.result.done():
            return False
        try:
            self.result.set_exception(error)
            return True
        except Exception:  # noqa: BLE001 - lost a race with another resolver
            return False

    def succeed(self) -> bool:
        if self.result.done():
            return False
        now = time.perf_counter()
        if self._num_layers:  # set before the result: whoever awaits it reads it
            self.tail_seconds = now - self._last_layer_at
        try:
            self.result.set_result(None)
        except Exception:  # noqa: BLE001
            return False
        if self.on_record is not None and self._num_layers:
            self.on_record(TransferRecord(
                self.transfer_id, self._num_bytes, self._num_layers, self.data_path, self._start_time,
                now - self._first_layer_at, now - self._last_layer_at, self.peer))
        return True


class KVSender(ABC):
    """Prefill side. One connection per peer, reused across transfers.

    `transfer_records`: the most recent completed transfers, oldest first; subclasses call
    `track(sink, peer_address)` on every sink they open."""

    backend: ClassVar[str]

    def __init__(self) -> None:
        self.transfer_records: deque[TransferRecord] = deque(maxlen=MAX_TRANSFER_RECORDS)

    def track(self, sink: SenderSink, peer_address: str) -> SenderSink:
        sink.on_record, sink.peer = self.transfer_records.append, peer_address
        return sink

    @abstractmethod
    def open(self, transfer_id: str, peer_address: str, layout: KVLayout,
             start_block: int = 0, timeout: float | None = None) -> SenderSink:
        """A sink to pass to `engine.add_request(kv_sink=...)`. `timeout` (default the
        configured transfer timeout) bounds the whole transfer, acknowledgement included."""

    @abstractmethod
    def close(self) -> None:
        """Fail open sinks with `TransferAborted`; close connections."""
