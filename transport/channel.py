"""One sender-side connection to one receiver: a DEALER socket owned by one thread.

Engine step threads hand layers to `ChannelSink`s, which queue them here and return at
once; the channel thread sends them in order, reads the receiver's ACK/NACK/RELEASE
replies, enforces each transfer's deadline, and fails every open transfer with
`PeerGone` when the TCP connection drops.

A layer the engine exported into a buffer its sink lent (the sender's `ExportPool`) gives
it back once nothing reads it: the data path's send returned and libzmq let go of the
zero-copy frames (their `MessageTracker`), at once if it was never sent; a send that
failed part-way leaves it to whoever may still read it, never to the next layer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from transport.address import PeerAddress
from transport.base import (
    PeerGone,
    SenderSink,
    TransferAborted,
    TransferError,
    TransferTimeout,
    error_from_wire,
)
from transport.export_pool import NO_LEASE, ExportLease, ExportPool, SinkLender
from transport.metrics import TransportMetrics
from transport.paths.base import SendPath
from transport.wire import ABORT, ACK, DONE, LAYER, NACK, RELEASE, Header, WireCodec, done_header
from workers.engine.kv_types import FirstToken, KVLayout
from workers.engine.sequence import TokenLogprob

log = logging.getLogger(__name__)


class Waker:
    """Lets other threads interrupt a zmq poll: a socketpair whose read end is polled."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def fileno(self) -> int:
        return self._r.fileno()

    def wake(self) -> None:
        try:
            self._w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already pending, or closing

    def drain(self) -> None:
        try:
            while self._r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        self._r.close()
        self._w.close()


class ChannelSink(SenderSink):
    """The `KVSink` handed to the prefill engine; everything goes through the channel."""

    def __init__(self, transfer_id: str, layout: KVLayout, start_block: int,
                 channel: PeerChannel, deadline: float) -> None:
        super().__init__(transfer_id, layout, start_block)
        self.fingerprint = layout.fingerprint()
        self.deadline = deadline
        self.next_seq = 0
        self.nbytes = 0
        self._channel = channel
        self._lender = SinkLender(channel.export_pool)
        self.data_path = channel.path.name

    def export_buffer(self, nbytes: int) -> torch.Tensor | None:
        return self._lender.lend(nbytes)

    def on_layer(self, layer_idx: int, kv: torch.Tensor, checksum: int | None = None) -> None:
        lease = self._lender.claim(kv)
        if self.done:
            lease.release()
            return
        self.layer_handed(kv)
        self._channel.submit(self, LAYER, (layer_idx, kv, checksum), lease)

    def on_complete(self, first_token_id: int, logprob: TokenLogprob | None = None,
                    siblings: tuple[FirstToken, ...] = ()) -> None:
        if not self.done:
            self._channel.submit(self, DONE, (int(first_token_id), logprob, tuple(siblings)))

    def on_abort(self, reason: str) -> None:
        self._lender.drop_unclaimed()
        if self.fail(TransferAborted(f"prefill aborted: {reason}", "prefill_abort",
                                     self.transfer_id)):
            self._channel.submit(self, ABORT, reason)


@dataclass
class _Item:
    sink: ChannelSink
    kind: str
    arg: object
    lease: ExportLease = NO_LEASE  # the lent buffer a LAYER's kv lives in, if any


class PeerChannel(threading.Thread):
    def __init__(self, ctx: zmq.Context, address: PeerAddress, path: SendPath, codec: WireCodec,
                 metrics: TransportMetrics, connect_timeout_s: float,
                 export_pool: ExportPool | None = None) -> None:
        super().__init__(name=f"kv-send-{address.host}:{address.port}", daemon=True)
        self.address, self.path, self.codec, self.metrics = address, path, codec, metrics
        self.connect_timeout_s = connect_timeout_s
        self.export_pool = export_pool or ExportPool()  # the sender's, shared by its channels
        self.broken = False  # set when unusable; the sender then opens a fresh channel
        self._ctx = ctx
        self._outbox: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._waker = Waker()
        self._sinks: dict[str, ChannelSink] = {}  # open transfers (channel thread only)
        self._hello_sent = False
        self.start()

    # -- any thread ---------------------------------------------------------------------------

    def open_sink(self, transfer_id: str, layout: KVLayout, start_block: int,
                  timeout_s: float) -> ChannelSink:
        sink = ChannelSink(transfer_id, layout, start_block, self, time.monotonic() + timeout_s)
        self.submit(sink, "open", None)
        return sink

    def submit(self, sink: ChannelSink, kind: str, arg: object,
               lease: ExportLease = NO_LEASE) -> None:
        if self.broken:
            sink.fail(PeerGone(f"connection to {self.address.endpoint} is closed",
                               transfer_id=sink.transfer_id))
            lease.release()
            return
        self._outbox.put(_Item(sink, kind, arg, lease))
        self._waker.wake()

    def stop(self) -> None:
        self.broken = True
        self._outbox.put(None)
        self._waker.wake()
        self.join(timeout=5)

    # -- channel thread -----------------------------------------------------------------------

    def run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, os.urandom(12))
        if self.address.curve_public_key:
            sock.curve_serverkey = self.address.curve_public_key.encode()
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address.endpoint)
        poller = zmq.Poller()
        for s in (sock, monitor, self._waker):
            poller.register(s, zmq.POLLIN)
        try:
            self._loop(sock, monitor, poller)
        except Exception as exc:  # noqa: BLE001 - never leave sinks hanging
            log.exception("kv sender channel to %s failed", self.address.endpoint)
            self._fail_all(PeerGone(f"sender channel failed: {exc}"))
        finally:
            self.broken = True
            self._drain_outbox_failing()
            with contextlib.suppress(zmq.ZMQError):  # the context may be terminating already
                sock.disable_monitor()
            monitor.close(0)  # every socket closes, or the sender's Context.term() never returns
            sock.close(0)
            self.path.close()
            self._waker.close()

    def _loop(self, sock: zmq.Socket, monitor: zmq.Socket, poller: zmq.Poller) -> None:
        while True:
            events = dict(poller.poll(self._poll_ms()))
            if self._waker.fileno() in events:
                self._waker.drain()
            if not self._send_queued(sock) or self.broken:
                return
            while sock.poll(0):
                self._on_reply(sock.recv_multipart())
            if monitor in events:
                while monitor.poll(0):
                    recv_monitor_message(monitor)
                self._fail_all(PeerGone(f"connection to {self.address.endpoint} lost"))
            self._expire(sock)

    def _poll_ms(self) -> int:
        deadline = min((s.deadline for s in self._sinks.values()), default=None)
        if deadline is None:
            return 1000
        return max(1, min(1000, int((deadline - time.monotonic()) * 1000) + 1))

    def _send_queued(self, sock: zmq.Socket) -> bool:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                self._fail_all(TransferAborted("sender closed"))
                return False
            self._send_item(sock, item)

    def _send_item(self, sock: zmq.Socket, item: _Item) -> None:
        sink = item.sink
        if item.kind == "open":
            self._sinks[sink.transfer_id] = sink
            return
        if sink.transfer_id not in self._sinks:
            item.lease.release()  # never sent: nothing reads the buffer
            return  # already resolved (failed or timed out); drop its remaining work
        try:
            if item.kind == LAYER:
                item.lease.release_when(self._send_layer(sock, sink, *item.arg,
                                                         track=item.lease is not NO_LEASE))
            elif item.kind == DONE:
                self._send(sock, sink, done_header(sink.transfer_id, 0, *item.arg))  # _send numbers it
            elif item.kind == ABORT:
                self._abort(sock, sink, "aborted", "prefill_abort", str(item.arg))
        except TransferError as exc:
            self._resolve(sink, exc)
            self._abort(sock, sink, exc.kind, exc.reason, str(exc))
            self._check_path()
        finally:
            item.lease.discard()  # a send that failed part-way may still read it (no-op if settled)

    def _check_path(self) -> None:
        """A data path whose stream fell out of step (a process group) is not reused."""
        if getattr(self.path, "broken", False) and not self.broken:
            self.broken = True
            self._fail_all(PeerGone(f"data path to {self.address.endpoint} broke"))

    def _send_layer(self, sock: zmq.Socket, sink: ChannelSink, layer_idx: int,
                    kv: torch.Tensor, checksum: int | None, track: bool) -> Callable[[], bool]:
        """Send one layer; returns whether its memory is no longer read (the data path's
        `after_send` has returned, so all that can still read it is libzmq's zero-copy
        frames). `track`: follow those frames (~20 us a message), for a lent buffer."""
        if not self._hello_sent:
            hello = self.path.hello()
            if hello is not None:
                sock.send_multipart(self.codec.seal(hello))
            self._hello_sent = True
        layout = sink.layout
        header = Header(LAYER, sink.transfer_id, layer_start=layer_idx, layer_end=layer_idx + 1,
                        dtype=layout.dtype, shape=[1, *kv.shape], block_size=layout.block_size,
                        fingerprint=sink.fingerprint, nbytes=kv.numel() * kv.element_size(),
                        data_path=self.path.name)
        header.seq = sink.next_seq
        frames = self.path.payload(header, kv, checksum)
        if track:
            frames = [zmq.Frame(f, track=True) for f in frames]
        sock.send_multipart(self.codec.seal(header) + frames, copy=False)
        sink.next_seq += 1
        sink.nbytes += header.nbytes
        self.path.after_send(header, kv)
        tracker = zmq.MessageTracker(*frames) if track else zmq.MessageTracker()
        return lambda: tracker.done

    def _send(self, sock: zmq.Socket, sink: ChannelSink, header: Header) -> None:
        header.seq = sink.next_seq
        sink.next_seq += 1
        sock.send_multipart(self.codec.seal(header))

    def _abort(self, sock: zmq.Socket, sink: ChannelSink, kind: str, reason: str,
               detail: str) -> None:
        """Tell the receiver so it frees the reservation now, not at its deadline."""
        self._resolve(sink, TransferAborted(detail, reason, sink.transfer_id))
        try:
            self._send(sock, sink, Header(ABORT, sink.transfer_id, error=kind, reason=reason,
                                          detail=detail[:512]))
        except zmq.ZMQError:
            pass

    def _on_reply(self, frames: list[bytes]) -> None:
        try:
            header = self.codec.open(frames[0], frames[1]) if len(frames) == 2 else None
        except TransferError as exc:
            header = None
            self.metrics.rejected(exc.reason)
        if header is None:
            log.warning("dropped a malformed reply from %s", self.address.endpoint)
            return
        if header.kind == RELEASE:
            self.path.on_release(header)
            return
        sink = self._sinks.get(header.transfer_id)
        if sink is None:
            return
        if header.kind == ACK:
            self._resolve(sink, None)
        elif header.kind == NACK:
            self._resolve(sink, error_from_wire(header.error, header.detail, header.reason,
                                                header.transfer_id))

    def _resolve(self, sink: ChannelSink, error: TransferError | None) -> None:
        self._sinks.pop(sink.transfer_id, None)
        self.path.on_transfer_end(sink.transfer_id)
        if error is None:
            sink.succeed()
        else:
            sink.fail(error)

    def _expire(self, sock: zmq.Socket) -> None:
        now = time.monotonic()
        for sink in [s for s in self._sinks.values() if s.deadline <= now]:
            error = TransferTimeout(f"no acknowledgement from {self.address.endpoint} for "
                                    f"{sink.transfer_id!r} in time (receiver gone or slow?)",
                                    transfer_id=sink.transfer_id)
            self._resolve(sink, error)
            self._abort(sock, sink, error.kind, error.reason, str(error))

    def _fail_all(self, error: TransferError) -> None:
        for sink in list(self._sinks.values()):
            self._resolve(sink, type(error)(str(error), error.reason, sink.transfer_id))

    def _drain_outbox_failing(self) -> None:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item.sink.fail(PeerGone("sender channel closed", transfer_id=item.sink.transfer_id))
                item.lease.release()
