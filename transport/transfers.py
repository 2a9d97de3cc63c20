"""The receiver's table of expected transfers: validation, writes, expiry, results.

Shared by every backend, so the rules are the same everywhere: a message must name a
transfer announced with `expect`, carry exactly the next sequence number, come from the
peer that sent the first message, match the reservation's layout, and fit the bounds.
Every failure cancels the reservation exactly once.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from transport.base import (
    KVReceiver,
    TransferAborted,
    TransferCorrupt,
    TransferError,
    TransferRejected,
    TransferTimeout,
    new_payload_digest,
)
from transport.metrics import TransportMetrics
from transport.wire import Header, first_token
from workers.engine.kv_types import (
    FirstToken,
    FramedKV,
    KVLayout,
    KVPayload,
    KVReservation,
    KVTarget,
    StreamedKV,
)

MAX_FINISHED = 8192  # ids remembered to reject replays and answer late `wait`s


@dataclass(frozen=True)
class Bounds:
    """The receiver's own limits: a header asking for more is rejected before allocation."""

    max_layer_bytes: int = 1 << 30
    max_blocks: int = 1 << 16


@dataclass
class Transfer:
    reservation: KVReservation
    deadline: float  # time.monotonic()
    future: Future[FirstToken] = field(default_factory=Future)
    next_seq: int = 0
    next_layer: int = 0
    peer: bytes | None = None  # bound by the first message
    data_path: str = ""
    nbytes: int = 0
    started_at: float = 0.0  # perf_counter() of the first message
    # A layer is being written into the reserved blocks. A failure meanwhile must not free
    # them under the writer (another request could get them): it is parked in `deferred`
    # and the writer cancels the reservation when it lets go. (`fail` never waits for a
    # writer: a payload read from a socket can take as long as its sender does.)
    writing: bool = False
    deferred: TransferError | None = None

    @property
    def failing(self) -> bool:
        """A failure is waiting for the current write to end: stop it early if possible."""
        return self.deferred is not None


class TransferTable:
    def __init__(self, target: KVTarget, bounds: Bounds, metrics: TransportMetrics,
                 default_ttl_s: float) -> None:
        self.target = target
        self.bounds = bounds
        self.metrics = metrics
        self.default_ttl_s = default_ttl_s
        self._lock = threading.Lock()
        self._pending: dict[str, Transfer] = {}
        self._finished: OrderedDict[str, Future[FirstToken]] = OrderedDict()
        layout = target.layout
        self._layout = layout
        self._fingerprint = layout.fingerprint()

    @property
    def layout(self) -> KVLayout:
        return self._layout

    # -- the receiver's API ------------------------------------------------------------------

    def expect(self, transfer_id: str, res: KVReservation, timeout: float | None) -> None:
        if res.layout.fingerprint() != self._fingerprint:
            raise ValueError("reservation layout differs from the receiver's target layout")
        if res.num_blocks_to_receive > self.bounds.max_blocks:
            raise ValueError(f"{res.num_blocks_to_receive} blocks exceed max_blocks")
        ttl = self.default_ttl_s if timeout is None else timeout
        with self._lock:
            if transfer_id in self._pending or transfer_id in self._finished:
                raise ValueError(f"transfer id {transfer_id!r} is pending or was used")
            self._pending[transfer_id] = Transfer(res, time.monotonic() + ttl)

    def future(self, transfer_id: str) -> Future[FirstToken]:
        with self._lock:
            t = self._pending.get(transfer_id)
            fut = t.future if t else self._finished.get(transfer_id)
        if fut is None:
            raise KeyError(f"transfer {transfer_id!r} was never expected (or is long gone)")
        return fut

    def pending_ids(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((t.deadline for t in self._pending.values()), default=None)

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [tid for tid, t in self._pending.items() if t.deadline <= now]
        for tid in due:
            self.fail(tid, TransferTimeout(f"transfer {tid} not complete before its deadline "
                                           "(sender dead or too slow?)", transfer_id=tid))

    # -- message handling --------------------------------------------------------------------

    def begin(self, header: Header, peer: bytes) -> Transfer:
        """The transfer this message belongs to, after the id, order and peer checks."""
        tid = header.transfer_id
        with self._lock:
            t = self._pending.get(tid)
            if t is None:
                reason = "replay" if tid in self._finished else "unknown"
                raise TransferRejected(f"transfer {tid!r} is not expected here ({reason})",
                                       reason, tid)
            if header.seq < t.next_seq:
                raise TransferRejected(f"message {header.seq} of {tid!r} was already seen",
                                       "replay", tid)
            if header.seq > t.next_seq:
                raise TransferRejected(f"message {header.seq} of {tid!r} arrived before "
                                       f"{t.next_seq}", "out_of_order", tid)
            if t.peer is None:
                t.peer, t.started_at = peer, time.perf_counter()
            elif t.peer != peer:
                raise TransferRejected(f"{tid!r} is bound to another peer", "peer_mismatch", tid)
            t.next_seq += 1
            return t

    def check_layer(self, t: Transfer, header: Header) -> tuple[int, ...]:
        """Validate a LAYER header against the reservation; returns the payload shape."""
        layout, tid = self._layout, header.transfer_id
        num_layers = header.layer_end - header.layer_start

        def reject(msg: str, reason: str) -> TransferRejected:
            return TransferRejected(f"{tid!r}: {msg}", reason, tid)

        if header.fingerprint != self._fingerprint:
            raise reject("layout fingerprint differs (other model or block size?)", "fingerprint")
        if header.dtype != layout.dtype or header.block_size != layout.block_size:
            raise reject(f"dtype/block size {header.dtype}/{header.block_size}", "fingerprint")
        if header.nbytes > self.bounds.max_layer_bytes * max(num_layers, 1):
            raise reject(f"{header.nbytes} bytes exceed the receiver's bound", "bounds")
        if header.layer_start != t.next_layer or not 0 < num_layers <= layout.num_layers - t.next_layer:
            raise reject(f"layers [{header.layer_start}, {header.layer_end}) out of order",
                         "out_of_order")
        shape = (num_layers, *layout.layer_shape(t.reservation.num_blocks_to_receive))
        if tuple(header.shape) != shape or header.nbytes != num_layers * layout.layer_nbytes(
                t.reservation.num_blocks_to_receive):
            raise reject(f"shape {header.shape} != expected {list(shape)}", "bounds")
        return shape

    def write(self, t: Transfer, header: Header, kv: KVPayload,
              checksum: int | None) -> None:
        """Copy layers into the reserved blocks (the one copy on the receive side), checking
        `checksum` (unless None) on the bytes as they land. On a mismatch the transfer fails
        and its blocks, never committed, are freed with the reservation."""
        self._start_write(t, header.transfer_id)
        if isinstance(kv, StreamedKV):
            kv.stream.stop_when(lambda: t.failing)
        try:
            self._copy_in(t, header, kv, checksum)
        finally:
            deferred = self._end_write(t)
        if deferred is not None:
            raise TransferRejected(f"{header.transfer_id!r} failed during the write: {deferred}",
                                   "late", header.transfer_id)

    def _start_write(self, t: Transfer, tid: str) -> None:
        with self._lock:
            if self._pending.get(tid) is not t:
                raise TransferRejected(f"{tid!r} already failed", "late", tid)
            t.writing = True

    def _end_write(self, t: Transfer) -> TransferError | None:
        """Let go of the blocks; returns (and carries out) a failure that came meanwhile."""
        with self._lock:
            t.writing = False
            deferred, t.deferred = t.deferred, None
        if deferred is not None:
            self._cancel(t, deferred)
        return deferred

    def _copy_in(self, t: Transfer, header: Header, kv: KVPayload,
                 checksum: int | None) -> None:
        tid = header.transfer_id
        digest = new_payload_digest() if checksum is not None else None
        for i in range(kv.shape[0]):
            self.target.write_kv_layer(t.reservation, header.layer_start + i, _layer(kv, i), digest)
        if digest is not None and digest.intdigest() != checksum:
            raise TransferCorrupt(f"payload of {tid!r} layer {header.layer_start} does not "
                                  "match its checksum", "checksum", tid)
        t.next_layer = header.layer_end
        t.nbytes += header.nbytes
        t.data_path = header.data_path

    def complete(self, t: Transfer, header: Header) -> None:
        tid = header.transfer_id
        if t.next_layer != self._layout.num_layers:
            raise TransferCorrupt(f"{tid!r} done after {t.next_layer} of "
                                  f"{self._layout.num_layers} layers", "incomplete", tid)
        with self._lock:
            if self._pending.pop(tid, None) is None:
                return
            self._remember(tid, t.future)
        self.metrics.transfer_done(t.data_path or "none", t.nbytes,
                                   time.perf_counter() - t.started_at)
        t.future.set_result(first_token(header))

    def fail(self, transfer_id: str, error: TransferError) -> bool:
        """Cancel the reservation and resolve with `error`; False if not pending."""
        error.transfer_id = error.transfer_id or transfer_id
        with self._lock:
            t = self._pending.pop(transfer_id, None)
            if t is None:
                return False
            self._remember(transfer_id, t.future)
            if t.writing:  # the writer cancels when it lets go of the blocks
                t.deferred = error
                return True
        self._cancel(t, error)
        return True

    def _cancel(self, t: Transfer, error: TransferError) -> None:
        self.target.cancel_kv(t.reservation)
        self.metrics.transfer_failed(error.kind)
        t.future.set_exception(error)

    def fail_all(self, error_factory) -> None:
        for tid in self.pending_ids():
            self.fail(tid, error_factory(tid))

    def _remember(self, transfer_id: str, fut: Future[FirstToken]) -> None:
        self._finished[transfer_id] = fut
        while len(self._finished) > MAX_FINISHED:
            self._finished.popitem(last=False)


class TableReceiver(KVReceiver):
    """A receiver whose bookkeeping is a `TransferTable` (`self.table`): every backend
    answers `expect`, `future`, `cancel` and `pending_ids` the same way."""

    table: TransferTable

    def expect(self, transfer_id: str, reservation: KVReservation,
               timeout: float | None = None) -> None:
        self.table.expect(transfer_id, reservation, timeout)

    def future(self, transfer_id: str) -> Future[FirstToken]:
        return self.table.future(transfer_id)

    def cancel(self, transfer_id: str, error: TransferError | None = None) -> None:
        self.table.fail(transfer_id, error or TransferAborted(
            f"transfer {transfer_id} cancelled by the decode side", "cancelled", transfer_id))

    def pending_ids(self) -> list[str]:
        return self.table.pending_ids()


def _layer(kv: KVPayload, i: int) -> KVPayload:
    """Layer `i` of a message's payload (a framed or streamed payload carries exactly one layer)."""
    if isinstance(kv, StreamedKV):
        if kv.shape[0] != 1 or i != 0:
            raise TransferCorrupt("a streamed payload must hold one layer", "malformed")
        return StreamedKV(kv.stream, kv.shape[1:], kv.dtype)
    if isinstance(kv, FramedKV):
        if kv.shape[0] != 1 or i != 0:
            raise TransferCorrupt("a payload sent as several frames must hold one layer", "malformed")
        return FramedKV(kv.pieces, kv.shape[1:], kv.dtype)
    return kv[i]

