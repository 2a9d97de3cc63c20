"""Authenticated data connections for the `tcp` data path: who may open one, and how.

A sender opens a plain TCP connection to the receiver's data port and writes a preamble:
a fresh 16-byte token and HMAC-SHA256(key, domain tag + token). The same token travels in
the sender's HELLO, itself MAC-authenticated on the ZMQ control plane, so the receiver
binds the connection to the ZMQ peer whose HELLO names it. A connection without the key
never gets past its first 48 bytes; a token is claimed once.

One thread serves the listening socket with a selector and never blocks on a client: a
connection that does not finish its preamble in time, or one too many waiting, is closed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

log = logging.getLogger(__name__)

TOKEN_LEN = 16
MAC_LEN = 32
PREAMBLE_LEN = TOKEN_LEN + MAC_LEN
_DOMAIN = b"pdc-kv-tcp-data/1\0"  # a preamble never verifies as any other message
MAX_WAITING = 64  # connections mid-preamble, or verified and not yet claimed by a HELLO


def new_token() -> bytes:
    return os.urandom(TOKEN_LEN)


def preamble(key: bytes, token: bytes) -> bytes:
    return token + hmac.new(key, _DOMAIN + token, hashlib.sha256).digest()


def tune(sock: socket.socket) -> None:
    """Small layers must not wait for Nagle; big ones are unaffected."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class DataAcceptor(threading.Thread):
    """Listens on `host:port` (0 = a free port, see `.port`) and holds verified connections
    until `claim(token)` takes them. Each refused connection is reported to `on_reject`
    with its reason (`bad_mac`, `replay`, `timeout`, `overload`)."""

    def __init__(self, host: str, port: int, key: bytes, timeout_s: float,
                 on_reject: Callable[[str], None] = lambda reason: None) -> None:
        super().__init__(name="kv-tcp-accept", daemon=True)
        self._key, self.timeout_s, self._on_reject = key, timeout_s, on_reject
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._partial: dict[socket.socket, tuple[float, bytearray]] = {}
        self._verified: OrderedDict[bytes, tuple[float, socket.socket]] = OrderedDict()
        self._cond = threading.Condition()
        self._stopping = False
        self.start()

    def claim(self, token: bytes, timeout_s: float) -> socket.socket | None:
        """The connection that presented `token`, waiting up to `timeout_s` for it."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while token not in self._verified and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            entry = self._verified.pop(token, None)
        return entry[1] if entry else None

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.join(timeout=2)

    # -- the acceptor thread ------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._selector.select(timeout=0.2):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._read_preamble(key.fileobj)
                self._expire()
        finally:
            self._shutdown()

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, OSError):
            return
        if len(self._partial) + len(self._verified) >= MAX_WAITING:
            self._refuse(conn, "overload", "too many connections waiting")
            return
        conn.setblocking(False)
        self._partial[conn] = (time.monotonic() + self.timeout_s, bytearray())
        self._selector.register(conn, selectors.EVENT_READ)

    def _read_preamble(self, conn: socket.socket) -> None:
        deadline, got = self._partial[conn]
        try:
            chunk = conn.recv(PREAMBLE_LEN - len(got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        got += chunk
        if len(got) < PREAMBLE_LEN:
            return
        self._selector.unregister(conn)
        del self._partial[conn]
        token, mac = bytes(got[:TOKEN_LEN]), bytes(got[TOKEN_LEN:])
        if not hmac.compare_digest(preamble(self._key, token)[TOKEN_LEN:], mac):
            self._refuse(conn, "bad_mac", "bad preamble MAC")
            return
        conn.setblocking(True)
        tune(conn)
        with self._cond:
            stale = self._verified.pop(token, None)
            self._verified[token] = (time.monotonic() + self.timeout_s, conn)
            self._cond.notify_all()
        if stale:
            self._refuse(stale[1], "replay", "token presented twice")

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c, (deadline, _) in self._partial.items() if deadline <= now]:
            self._selector.unregister(conn)
            del self._partial[conn]
            self._refuse(conn, "timeout", "preamble not sent in time")
        with self._cond:
            late = [t for t, (deadline, _) in self._verified.items() if deadline <= now]
            stale = [self._verified.pop(t)[1] for t in late]
        for conn in stale:
            self._refuse(conn, "timeout", "no HELLO claimed the connection in time")

    def _drop(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        del self._partial[conn]
        self._refuse(conn, "malformed", "closed during its preamble")

    def _refuse(self, conn: socket.socket, reason: str, why: str) -> None:
        log.warning("kv data connection refused: %s", why)
        self._on_reject(reason)  # counted before the peer can see the close
        conn.close()

    def _shutdown(self) -> None:
        for conn in list(self._partial):
            conn.close()
        with self._cond:
            for _, conn in self._verified.values():
                conn.close()
            self._verified.clear()
        self._selector.close()
        self._listener.close()
