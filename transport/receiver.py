"""The receiving half of the ZMQ control plane, shared by every network backend.

The receiver binds one ROUTER socket; one thread reads it, checks each header's MAC,
and hands the message to the shared `TransferTable`. Data paths that block (a per-pair
process group) run on one worker thread per peer, so a slow or dead peer never stalls
the others.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import zmq

from transport.address import PeerAddress, default_node_id, reachable_host
from transport.base import (
    TransferAborted,
    TransferCorrupt,
    TransferError,
    TransferRejected,
)
from transport.channel import Waker
from transport.config import TransportConfig
from transport.metrics import TransportMetrics
from transport.paths.base import RecvPath
from transport.paths.inline import InlineRecvPath
from transport.transfers import TableReceiver, TransferTable
from transport.wire import ABORT, ACK, DONE, HELLO, LAYER, NACK, Header, WireCodec
from workers.engine.kv_types import KVReservation, KVTarget
from workers.engine.warm_memory import keep_freed_memory_warm

log = logging.getLogger(__name__)

# Authenticated messages that must not fail the transfer they name: a replay or a copy
# from another connection is an attacker's or a duplicate's, not the sender's, fault.
_NON_FATAL = frozenset(("replay", "peer_mismatch", "unknown", "late"))


class ZmqReceiver(TableReceiver):
    backend = "zmq"

    def __init__(self, config: TransportConfig, target: KVTarget, key: bytes,
                 recv_paths: list[RecvPath] | None = None,
                 metrics: TransportMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or TransportMetrics()
        self.codec = WireCodec(key, config.wire_limits)
        keep_freed_memory_warm()  # each received layer is a multi-MiB allocation
        self.table = TransferTable(target, config.bounds, self.metrics, config.reservation_ttl)
        self._paths = {p.name: p for p in (recv_paths or [InlineRecvPath()])}
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._bind()
        self._outbox: queue.SimpleQueue[tuple[bytes, Header]] = queue.SimpleQueue()
        self._waker = Waker()
        self._workers: dict[bytes, _PeerWorker] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-recv", daemon=True)
        self._thread.start()

    def _bind(self) -> zmq.Socket:
        cfg = self.config
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Bounds what one frame may make libzmq allocate; a bigger one drops the peer.
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_layer_bytes + cfg.max_header_bytes)
        curve_public = ""
        if cfg.curve:
            public, secret = zmq.curve_keypair()
            sock.curve_server = True
            sock.curve_secretkey = secret
            curve_public = public.decode()
        bind_host = cfg.host or reachable_host(None)
        host = f"[{bind_host}]" if ":" in bind_host else bind_host
        if ":" in bind_host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(f"tcp://{host}:{cfg.port or '*'}")
        port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        fields = {k: v for p in self._paths.values() for k, v in p.address_fields().items()}
        self._address = PeerAddress("tcp", reachable_host(cfg.host), port,
                                    cfg.node_id or default_node_id(), tuple(self._paths),
                                    curve_public, **fields)
        return sock

    # -- KVReceiver ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return str(self._address)

    def expect(self, transfer_id: str, reservation: KVReservation,
               timeout: float | None = None) -> None:
        super().expect(transfer_id, reservation, timeout)
        self._waker.wake()  # recompute the poll timeout for the new deadline

    def close(self) -> None:
        self._stopping.set()
        self._waker.wake()
        self._thread.join(timeout=5)
        for worker in self._workers.values():
            worker.stop()
        self.table.fail_all(lambda tid: TransferAborted("receiver closed", "closed", tid))
        for path in self._paths.values():
            path.close()
        self._sock.close(0)
        self._ctx.term()
        self._waker.close()

    # -- socket thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker, zmq.POLLIN)
        while not self._stopping.is_set():
            events = dict(poller.poll(self._poll_ms()))
            if self._waker.fileno() in events:
                self._waker.drain()
            for _ in range(64):  # bounded, so expiry and replies are never starved
                if not self._sock.poll(0):
                    break
                self._on_message(self._sock.recv_multipart(copy=False))
            self._flush_outbox()
            self.table.expire()

    def _poll_ms(self) -> int:
        import time

        deadline = self.table.next_deadline()
        if deadline is None:
            return 500
        return max(1, min(500, int((deadline - time.monotonic()) * 1000) + 1))

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        try:
            if len(frames) < 3:
                raise TransferCorrupt("message has fewer than header + MAC frames", "malformed")
            header = self.codec.open(frames[1].bytes, frames[2].bytes)
        except TransferError as exc:
            # The MAC failed, or an authenticated peer speaks another protocol version.
            self._reject(peer, exc, fail=exc.reason == "version")
            return
        try:
            if header.kind == HELLO:
                self._on_hello(peer, header)
            elif peer in self._workers:
                self._workers[peer].submit(header, frames[3:])
            else:
                self.handle(peer, header, frames[3:])
        except TransferError as exc:
            self._reject(peer, exc, fail=False)

    def _on_hello(self, peer: bytes, header: Header) -> None:
        path = self._paths.get(header.data_path)
        if path is None:
            raise TransferRejected(f"data path {header.data_path!r} not accepted", "data_path")
        self._retire_gone_peers()  # a new connection is when old ones have usually gone
        if path.blocking and peer not in self._workers:
            self._workers[peer] = _PeerWorker(self, peer)
        if path.blocking:
            self._workers[peer].submit(header, [])
        else:
            path.on_hello(peer, header, self._reply_fn(peer))

    def _retire_gone_peers(self) -> None:
        for path in self._paths.values():
            for gone in path.reap():
                worker = self._workers.pop(gone, None)
                if worker is not None:
                    worker.retire()

    @property
    def num_peer_workers(self) -> int:
        return len(self._workers)

    def handle(self, peer: bytes, header: Header, payload: list) -> None:
        """Process one authenticated message, in per-peer order."""
        t = None
        payload_in_flight = header.kind == LAYER  # until a data path has taken it
        try:
            if header.kind == HELLO:  # only reaches here on a worker thread
                self._paths[header.data_path].on_hello(peer, header, self._reply_fn(peer))
                return
            t = self.table.begin(header, peer)
            if header.kind == LAYER:
                path, shape = self._layer_path(header), self.table.check_layer(t, header)
                payload_in_flight = False
                self._on_layer(peer, header, payload, t, path, shape)
            elif header.kind == DONE:
                self.table.complete(t, header)
                self.reply(peer, Header(ACK, header.transfer_id))
            elif header.kind == ABORT:
                self.table.fail(header.transfer_id, TransferAborted(
                    f"sender aborted: {header.detail}", header.reason or "sender_abort"))
            else:
                raise TransferCorrupt(f"unexpected {header.kind!r} message", "malformed")
        except TransferError as exc:
            if payload_in_flight:
                self._drop_payload(peer, header)
            exc.transfer_id = exc.transfer_id or header.transfer_id
            self._reject(peer, exc, fail=t is not None and exc.reason not in _NON_FATAL)
        except Exception as exc:  # noqa: BLE001 - e.g. the target refused the write
            log.exception("kv receive of %s failed", header.transfer_id)
            err = TransferCorrupt(f"receive failed: {type(exc).__name__}: {exc}", "write_failed",
                                  header.transfer_id)
            self._reject(peer, err, fail=t is not None)

    def _layer_path(self, header: Header) -> RecvPath:
        path = self._paths.get(header.data_path)
        if path is None:
            raise TransferRejected(f"data path {header.data_path!r} not accepted", "data_path",
                                   header.transfer_id)
        return path

    def _on_layer(self, peer: bytes, header: Header, payload: list, t, path: RecvPath,
                  shape: tuple[int, ...]) -> None:
        received = path.read(peer, header, payload, shape, self._reply_fn(peer))
        try:
            self.table.write(t, header, received.kv, received.checksum)
        finally:
            received.release()

    def _drop_payload(self, peer: bytes, header: Header) -> None:
        """A rejected layer's payload may still be on its way over another channel (a
        process group's send): take it off and drop it, so the pair stays in step and one
        refused transfer (cancelled, expired, unknown) never stalls the peer's next ones."""
        path = self._paths.get(header.data_path)
        if path is not None:
            path.discard(peer, header, self.table.bounds.max_layer_bytes)

    def _reject(self, peer: bytes, exc: TransferError, fail: bool) -> None:
        self.metrics.rejected(exc.reason)
        log.warning("kv transfer message rejected (%s): %s", exc.reason, exc)
        if fail and exc.transfer_id:
            self.table.fail(exc.transfer_id, exc)
        if exc.transfer_id:
            self.reply(peer, Header(NACK, exc.transfer_id, error=exc.kind, reason=exc.reason,
                                    detail=str(exc)[:512]))

    def _reply_fn(self, peer: bytes) -> Callable[[Header], None]:
        return lambda header: self.reply(peer, header)

    def reply(self, peer: bytes, header: Header) -> None:
        """Queue a control message to a peer; safe from any thread."""
        self._outbox.put((peer, header))
        if threading.current_thread() is not self._thread:
            self._waker.wake()

    def _flush_outbox(self) -> None:
        while True:
            try:
                peer, header = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._sock.send_multipart([peer, *self.codec.seal(header)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the peer is gone; it learns by its own timeout


class _PeerWorker(threading.Thread):
    """Processes one peer's messages in order, off the socket thread."""

    def __init__(self, receiver: ZmqReceiver, peer: bytes) -> None:
        super().__init__(name="kv-recv-peer", daemon=True)
        self._receiver, self._peer = receiver, peer
        self._inbox: queue.SimpleQueue[tuple[Header, list] | None] = queue.SimpleQueue()
        self.start()

    def submit(self, header: Header, payload: list) -> None:
        self._inbox.put((header, payload))

    def retire(self) -> None:
        """Exit after the messages already queued; never waits (called on the socket thread)."""
        self._inbox.put(None)

    def stop(self) -> None:
        self.retire()
        self.join(timeout=1)

    def run(self) -> None:
        while (item := self._inbox.get()) is not None:
            self._receiver.handle(self._peer, *item)
