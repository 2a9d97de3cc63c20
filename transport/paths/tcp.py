"""The `tcp` data path: ZMQ headers, payload over a per-pair TCP stream that the receiver
reads straight into the reserved KV blocks.

Why not the payload in ZMQ frames (`inline`): a received ZMQ message lands in memory
libzmq allocates, so the receiver pays one more copy, message to blocks, beside the
kernel's copies in and out. On a 2-core node that copy competes with the kernel's for the
same cores and cost a fifth of the throughput (`bench transport`: zmq inline 0.72-0.93 of a
raw socket, and 1.0 with the copy skipped). Here the receiver `recv_into`s each block
span itself, hashing every 512 KiB piece right after it lands.

The pair's stream is ordered like the ZMQ headers: every LAYER header announces exactly
`nbytes` on the stream, which the receiver reads into the blocks, or drains when it
refused the header, so one refused transfer never stalls the next. A stream that falls
out of step (a sender that died or stalled mid-layer, a layer given up because its
transfer failed meanwhile) is closed on both sides; the sender's channel then reconnects
with a fresh HELLO, and the transfers it carried fail over to local prefill.

The payload is not encrypted: with `curve` on, receivers do not offer this path.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable

import torch

from transport.address import PeerAddress
from transport.base import PeerGone, TransferAborted, TransferCorrupt
from transport.paths.base import Received, RecvPath, Reply, SendPath
from transport.paths.tcp_accept import TOKEN_LEN, DataAcceptor, new_token, preamble, tune
from transport.wire import HELLO, TCP, Header, payload_checksum
from workers.engine.kv_cache import tensor_bytes
from workers.engine.kv_types import StreamedKV

_SLICE_S = 0.25  # how often a waiting read looks at its stop condition
_DRAIN_BYTES = 1 << 20


class TcpSendPath(SendPath):
    """Sending half: one data connection, opened with the HELLO, written by the channel thread."""

    name = TCP

    def __init__(self, peer: PeerAddress, key: bytes, connect_timeout_s: float,
                 send_timeout_s: float) -> None:
        self.peer, self._key = peer, key
        self.connect_timeout_s, self.send_timeout_s = connect_timeout_s, send_timeout_s
        self.broken = False
        self._sock: socket.socket | None = None
        self._outgoing: memoryview | None = None  # the layer `payload` readied for `after_send`

    def hello(self) -> Header:
        token = new_token()
        try:
            sock = socket.create_connection((self.peer.host, self.peer.data_port),
                                            timeout=self.connect_timeout_s)
            tune(sock)
            sock.sendall(preamble(self._key, token))
            sock.settimeout(self.send_timeout_s)
        except OSError as exc:
            self.broken = True
            raise PeerGone(f"cannot open the data connection to {self.peer.host}:"
                           f"{self.peer.data_port}: {exc}", "tcp_connect") from None
        self._sock = sock
        return Header(HELLO, "", data_path=TCP, extra={"token": token.hex()})

    def payload(self, header: Header, kv: torch.Tensor, checksum: int | None = None) -> list:
        # Host bytes made once (a CUDA layer's one copy to host), hashed if need be, then
        # written by `after_send` once the header is queued.
        self._outgoing = tensor_bytes(kv.detach().cpu().contiguous())
        header.checksum = payload_checksum(self._outgoing) if checksum is None else checksum
        return []

    def after_send(self, header: Header, kv: torch.Tensor) -> None:
        data, self._outgoing = self._outgoing, None
        if self._sock is None or self.broken or data is None:
            raise PeerGone("no data connection", "tcp_send", header.transfer_id)
        try:
            self._sock.sendall(data)
        except OSError as exc:  # the pair's stream is now out of step
            self.broken = True
            raise PeerGone(f"data connection send failed: {type(exc).__name__}: {exc}",
                           "tcp_send", header.transfer_id) from None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class SocketStream:
    """`nbytes` of one layer on a data connection, read in order (a `ByteStream`).

    `fill` gives up, and the connection is dropped, when the sender sends nothing for
    `stall_s`, or sooner once `stop()` holds (the transfer failed elsewhere)."""

    def __init__(self, sock: socket.socket, nbytes: int, stall_s: float,
                 on_broken: Callable[[], None]) -> None:
        self.sock, self.remaining, self.stall_s = sock, nbytes, stall_s
        self._on_broken = on_broken
        self._stop: Callable[[], bool] = lambda: False

    def stop_when(self, stop: Callable[[], bool]) -> None:
        self._stop = stop

    def fill(self, view: memoryview) -> None:
        if len(view) > self.remaining:
            raise TransferCorrupt("read past the announced payload", "malformed")
        got, quiet_since = 0, time.monotonic()
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                self._check_waiting(quiet_since)
                continue
            except OSError as exc:
                self._broken(PeerGone(f"data connection failed: {exc}", "tcp_recv"))
            if not n:
                self._broken(PeerGone("the sender closed the data connection mid-layer", "tcp_recv"))
            got, quiet_since = got + n, time.monotonic()
            self.remaining -= n

    def finish(self) -> None:
        """Drain what the reader did not take (its write was refused), keeping the stream
        in step; drops the connection if that fails."""
        if self.remaining:
            scratch = memoryview(bytearray(min(self.remaining, _DRAIN_BYTES)))
            self._stop = lambda: False  # the bytes are on their way: take them off
            while self.remaining:
                self.fill(scratch[: min(self.remaining, len(scratch))])

    def _check_waiting(self, quiet_since: float) -> None:
        if self._stop():
            self._broken(TransferAborted("transfer failed while its layer was arriving",
                                         "cancelled"))
        if time.monotonic() - quiet_since > self.stall_s:
            self._broken(PeerGone(f"the sender sent nothing for {self.stall_s:.0f} s mid-layer",
                                  "tcp_stall"))

    def _broken(self, error: Exception) -> None:
        self.remaining = 0
        self._on_broken()
        raise error


class TcpRecvPath(RecvPath):
    """Receiving half: the acceptor binds each verified connection to the ZMQ peer whose
    HELLO carries its token; reads happen on that peer's worker thread."""

    name = TCP
    blocking = True

    def __init__(self, host: str, port: int, key: bytes, timeout_s: float,
                 on_reject: Callable[[str], None] = lambda reason: None) -> None:
        self.timeout_s = timeout_s
        self._acceptor = DataAcceptor(host, port, key, timeout_s, on_reject)
        self._conns: dict[bytes, socket.socket] = {}
        self._reading: set[bytes] = set()  # peers whose layer a reader is taking off the stream
        self._lock = threading.Lock()

    def address_fields(self) -> dict[str, int]:
        return {"data_port": self._acceptor.port}

    def on_hello(self, peer: bytes, header: Header, reply: Reply) -> None:
        token = header.extra.get("token")
        try:
            raw = bytes.fromhex(token) if isinstance(token, str) else b""
        except ValueError:
            raw = b""
        if len(raw) != TOKEN_LEN:
            raise TransferCorrupt("bad tcp data-path handshake", "malformed")
        sock = self._acceptor.claim(raw, self.timeout_s)
        if sock is None:
            raise PeerGone("the data connection named in a HELLO never arrived", "tcp_connect")
        sock.settimeout(_SLICE_S)
        self._replace(peer, sock)

    def read(self, peer: bytes, header: Header, frames: list, shape: tuple[int, ...],
             reply: Reply) -> Received:
        with self._lock:
            sock = self._conns.get(peer)
        if sock is None or frames:
            raise TransferCorrupt(f"{header.transfer_id!r}: no data connection with this peer",
                                  "malformed", header.transfer_id)
        stream = SocketStream(sock, header.nbytes, self.timeout_s, lambda: self._replace(peer, None))
        with self._lock:
            self._reading.add(peer)

        def release() -> None:
            try:
                stream.finish()
            finally:
                with self._lock:
                    self._reading.discard(peer)

        return Received(StreamedKV(stream, tuple(shape), getattr(torch, header.dtype)),
                        header.checksum, release)

    def reap(self) -> list[bytes]:
        """Close the connections of senders that went away (their end closed: a restarted or
        scaled-down prefill replica) and return those peers, so the receiver can retire
        their worker threads. Peeking never takes bytes off a live stream."""
        with self._lock:
            idle = [(p, s) for p, s in self._conns.items() if p not in self._reading]
        gone = [peer for peer, sock in idle if _closed_by_peer(sock)]
        for peer in gone:
            self._replace(peer, None)
        return gone

    def discard(self, peer: bytes, header: Header, max_bytes: int) -> None:
        """Drain a refused layer's payload; one that cannot be received safely (beyond
        `max_bytes`) drops the connection instead, and the sender reconnects."""
        with self._lock:
            sock = self._conns.get(peer)
        if sock is None:
            return
        if not 0 <= header.nbytes <= max_bytes:
            self._replace(peer, None)
            return
        try:
            SocketStream(sock, header.nbytes, self.timeout_s,
                         lambda: self._replace(peer, None)).finish()
        except Exception:  # noqa: BLE001 - out of step now: the connection is gone
            pass

    def num_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _replace(self, peer: bytes, sock: socket.socket | None) -> None:
        with self._lock:
            old = self._conns.pop(peer, None)
            if sock is not None:
                self._conns[peer] = sock
        if old is not None and old is not sock:
            old.close()

    def close(self) -> None:
        self._acceptor.close()
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for sock in conns:
            sock.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the sender's end closed. Polled first: a socket with a timeout waits that
    long inside `recv` even with MSG_DONTWAIT, and its TimeoutError says nothing of the peer."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True  # closed here already
    if not readable:
        return False  # open, nothing pending
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""  # at EOF, or bytes of a coming layer
    except TimeoutError:
        return False  # a reader took the bytes meanwhile
    except OSError:
        return True  # reset
