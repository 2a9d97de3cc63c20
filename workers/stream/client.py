"""The calling side of the worker stream: `generate` on a chosen replica over ZeroMQ
(from the router), and `prefill` on a chosen prefill replica (from a decode replica).

`WorkerStreams.call(address, request)` returns a `StreamCall`, an async iterator of
`GenerateChunk` with `cancel()`, the same shape as Serve's streaming handle response, so
router/dispatch.py treats both alike; `call(..., "prefill")` yields one `PrefillResult`. One DEALER socket per replica address, shared by
every call to it, with one reader task that hands each chunk to its call.

A replica that dies is noticed two ways, whichever comes first: ZeroMQ reports the
connection closed (a killed process), or the replica stops answering the pings sent
every `ping_interval_s` for `silence_timeout_s` (a lost machine). Every open call on it
then raises `ReplicaGone`, which dispatch retries on another replica when no chunk has
arrived yet, exactly as for a dead Serve replica. A replica shutting down refuses new
calls the same way and finishes the open ones; `retain` closes a peer the view dropped
once it has no call open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from workers.protocol import GenerateRequest, PrefillRequest
from workers.stream.wire import (
    CANCEL,
    CHUNK,
    DRAINING,
    END,
    OPEN,
    PING,
    REPLIES,
    StreamAuthError,
    StreamCodec,
    StreamRejected,
    to_wire,
)

log = logging.getLogger("pdcluster.router")
PING_INTERVAL_S = 1.0
SILENCE_TIMEOUT_S = 5.0


class ReplicaGone(Exception):
    """The replica's stream closed or went silent before the call finished."""


class WorkerCallFailed(Exception):
    """The replica's `generate` raised; its message says what."""


class StreamCall:
    def __init__(self, peer: _Peer, call_id: int, method: str = "generate") -> None:
        self._peer = peer
        self.call_id = call_id
        self._reply = REPLIES[method]
        self._queue: asyncio.Queue[Any] = asyncio.Queue()  # replies, then None or an exception
        self._next_index = 0
        self.done = False

    def __aiter__(self) -> StreamCall:
        return self

    async def __anext__(self) -> Any:
        if self.done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if not isinstance(item, BaseException) and item is not None:
            return item
        self._finish()
        if item is None:
            raise StopAsyncIteration
        raise item

    def cancel(self) -> None:
        """Abort the call on the replica (idempotent; nothing to do once it ended)."""
        if not self.done:
            self._finish()
            self._peer.send({"t": CANCEL, "id": self.call_id})

    def _deliver(self, msg: dict) -> None:
        if msg.get("i") != self._next_index:
            self._queue.put_nowait(ReplicaGone(f"stream out of order at chunk {self._next_index}"))
            return
        self._next_index += 1
        if msg["t"] == CHUNK:
            self._queue.put_nowait(self._reply(msg.get("c")))
        elif msg.get("error") == DRAINING and self._next_index == 1:  # refused before any chunk
            self._queue.put_nowait(ReplicaGone(f"the replica at {self._peer.address} is shutting down"))
        elif msg.get("error"):
            self._queue.put_nowait(WorkerCallFailed(str(msg["error"])))
        else:
            self._queue.put_nowait(None)

    def _fail(self, exc: BaseException) -> None:
        self._queue.put_nowait(exc)

    def _finish(self) -> None:
        self.done = True
        self._peer.calls.pop(self.call_id, None)


class WorkerStreams:
    def __init__(self, codec: StreamCodec, ping_interval_s: float = PING_INTERVAL_S,
                 silence_timeout_s: float = SILENCE_TIMEOUT_S) -> None:
        self.codec = codec
        self.ping_interval_s = ping_interval_s
        self.silence_timeout_s = silence_timeout_s
        self.session = uuid.uuid4().hex
        self._seq = 0
        self._ctx: zmq.asyncio.Context | None = None
        self.peers: dict[str, _Peer] = {}

    def call(self, address: str, request: GenerateRequest | PrefillRequest, method: str = "generate") -> StreamCall:
        """`generate` (a stream of GenerateChunk) or `prefill` (one PrefillResult) there."""
        peer = self.peers.get(address)
        if peer is None or peer.closed:
            peer = self.peers[address] = _Peer(self, address)
        call = StreamCall(peer, random.getrandbits(63), method)
        peer.calls[call.call_id] = call
        peer.send({"t": OPEN, "m": method, "id": call.call_id, "req": to_wire(request)})
        return call

    def retain(self, addresses: set[str]) -> None:
        """Close the idle peers the cluster view no longer has. One with calls open stays
        until they end: a draining replica finishes them (a dead one is noticed by the
        connection closing or by its silence, and its calls fail then)."""
        for address in [a for a, p in self.peers.items() if a not in addresses and not p.calls]:
            self.peers.pop(address).close(ReplicaGone(f"replica at {address} left the cluster"))

    def close(self) -> None:
        for peer in list(self.peers.values()):
            peer.close(ReplicaGone("router shutting down"))
        self.peers.clear()
        if self._ctx is not None:
            self._ctx.term()

    def context(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    def stamp(self, message: dict) -> dict:
        self._seq += 1
        return {**message, "s": self.session, "n": self._seq, "ts": time.time()}


class _Peer:
    def __init__(self, streams: WorkerStreams, address: str) -> None:
        self.streams, self.address = streams, address
        self.calls: dict[int, StreamCall] = {}
        self.closed = False
        self.sock = streams.context().socket(zmq.DEALER)
        for option, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0),
                              (zmq.IPV6, int(address.startswith("tcp://["))),):
            self.sock.setsockopt(option, value)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        self.heard = time.monotonic()
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._read()), loop.create_task(self._ping()),
                      loop.create_task(self._watch())]

    def send(self, message: dict) -> None:
        if self.closed:
            return
        sent = self.sock.send_multipart(self.streams.codec.seal(self.streams.stamp(message)))
        sent.add_done_callback(_quiet)

    def close(self, reason: BaseException) -> None:
        if self.closed:
            return
        self.closed = True
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        for call in list(self.calls.values()):
            call._fail(reason)
        self.calls.clear()
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        if self.streams.peers.get(self.address) is self:
            del self.streams.peers[self.address]

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                msg = self.streams.codec.open(frames)
            except (StreamAuthError, StreamRejected) as exc:
                log.warning("worker stream %s: dropped a reply (%s)", self.address, exc)
                continue
            self.heard = time.monotonic()
            call = self.calls.get(msg.get("id")) if msg["t"] in (CHUNK, END) else None
            if call is not None:
                try:
                    call._deliver(msg)
                except StreamRejected as exc:
                    call._fail(ReplicaGone(f"malformed chunk: {exc}"))

    async def _ping(self) -> None:
        while True:
            self.send({"t": PING})
            await asyncio.sleep(self.streams.ping_interval_s)
            if time.monotonic() - self.heard > self.streams.silence_timeout_s:
                log.warning("worker stream %s: silent for %.1f s; closing", self.address,
                            self.streams.silence_timeout_s)
                self.close(ReplicaGone(f"replica at {self.address} stopped answering"))
                return

    async def _watch(self) -> None:
        frames = await self.monitor.recv_multipart()
        event = parse_monitor_message(frames)
        log.warning("worker stream %s: connection closed (event %s)", self.address, event["event"])
        self.close(ReplicaGone(f"connection to the replica at {self.address} closed"))


def _quiet(future) -> None:
    if not future.cancelled():
        future.exception()


def worker_streams(config, transport_key: str | None) -> WorkerStreams | None:
    """Streams to the workers (the router's, or a decode replica's to prefill replicas),
    sealed with the transport key the app builder handed out; None when the config sends
    calls through Serve handles (`router.worker_stream: false`)."""
    if not config.router.worker_stream:
        return None
    from workers.kv_transport import stream_codec

    return WorkerStreams(stream_codec(transport_key))
