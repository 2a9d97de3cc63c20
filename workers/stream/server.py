"""A worker replica's `generate`, served to routers over one authenticated ZeroMQ socket.

A Serve handle call costs a few milliseconds each way on this path (Ray's actor call,
Serve's request routing, the replica's task queue), once for the first token and again
for every chunk after it. Here a router's OPEN starts a call on this replica's event
loop and each chunk goes back as one message (workers/stream/wire.py). The router picks
the replica itself (router/placement.py), so Serve's routing has nothing to add.

Lifetimes: a CANCEL, a router that stops pinging for `session_timeout_s`, or a send that
finds the router gone cancels the call, which closes the worker's generator and so
aborts the engine request, exactly as a cancelled Serve call does. `drain` (Serve's
graceful shutdown) refuses new calls, which their routers retry on another replica,
and waits for the open ones. The socket binds the configured transport host only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from workers.stream.wire import (
    CANCEL,
    CHUNK,
    DRAINING,
    END,
    OPEN,
    PING,
    PONG,
    REQUESTS,
    ReplayGuard,
    StreamAuthError,
    StreamCodec,
    StreamRejected,
    to_wire,
)

log = logging.getLogger("pdcluster.worker")
SESSION_TIMEOUT_S = 5.0  # a router silent this long is gone: its calls are cancelled
Handler = Callable[[Any], AsyncIterator[Any]]  # a request -> its replies (dataclasses)


class StreamServer:
    def __init__(self, handlers: dict[str, Handler], codec: StreamCodec, host: str, port: int = 0,
                 session_timeout_s: float = SESSION_TIMEOUT_S) -> None:
        """`handlers`: method name ("generate", "prefill"; see workers.stream.wire.REQUESTS) -> handler."""
        assert set(handlers) <= set(REQUESTS), handlers
        self._handlers = handlers
        self._codec = codec
        self._guard = ReplayGuard()
        self.session_timeout_s = session_timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        for option, value in ((zmq.LINGER, 0), (zmq.ROUTER_MANDATORY, 1), (zmq.SNDHWM, 0),
                              (zmq.RCVHWM, 0), (zmq.IPV6, int(":" in host))):
            self._sock.setsockopt(option, value)
        bracketed = f"[{host}]" if ":" in host else host
        if port:
            self._sock.bind(f"tcp://{bracketed}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{bracketed}")
        self.address = f"tcp://{bracketed}:{port}"
        self.calls: dict[tuple[bytes, int], asyncio.Task] = {}
        self._heard: dict[bytes, float] = {}  # router identity -> last message (monotonic)
        self.rejected: Counter[str] = Counter()
        self.calls_total: Counter[str] = Counter()  # by method
        self.draining = False
        self._tasks: list[asyncio.Task] = []

    def start(self) -> StreamServer:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._serve()), loop.create_task(self._reap())]
        return self

    async def drain(self, timeout_s: float) -> int:
        """Refuse new calls and wait up to `timeout_s` for the open ones to finish;
        returns how many are still open."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.calls and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(self.calls)

    def close(self) -> None:
        for task in [*self._tasks, *self.calls.values()]:
            task.cancel()
        self._sock.close(linger=0)
        self._ctx.term()

    # ---- receiving -------------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            identity, *frames = await self._sock.recv_multipart()
            try:
                msg = self._codec.open(frames)
                self._guard.check(msg)
            except (StreamAuthError, StreamRejected) as exc:
                self._reject(exc)
                continue
            self._heard[identity] = time.monotonic()
            try:
                self._on_message(identity, msg)
            except StreamRejected as exc:
                self._reject(exc)
            except _RouterGone:
                pass  # it left between its message and our answer

    def _on_message(self, identity: bytes, msg: dict) -> None:
        kind, call_id = msg["t"], msg.get("id")
        if kind == PING:
            self._send(identity, {"t": PONG})
            return
        if not isinstance(call_id, int):
            raise StreamRejected("message without a call id")
        if kind == OPEN and self.draining:
            self._send(identity, {"t": END, "id": call_id, "i": 0, "error": DRAINING})
        elif kind == OPEN:
            try:
                self._open(identity, call_id, msg)
            except StreamRejected as exc:  # authentic, so the router hears why at once
                self._reject(exc)
                with contextlib.suppress(_RouterGone):
                    self._send(identity, {"t": END, "id": call_id, "i": 0, "error": f"refused: {exc}"})
        elif kind == CANCEL:
            task = self.calls.get((identity, call_id))
            if task is not None:
                task.cancel()
        else:
            raise StreamRejected(f"unexpected {kind!r} from a router")

    def _open(self, identity: bytes, call_id: int, msg: dict) -> None:
        method = msg.get("m")
        if method not in self._handlers:
            raise StreamRejected(f"no method {method!r} here")
        request = REQUESTS[method](msg.get("req"))
        if (identity, call_id) in self.calls:
            raise StreamRejected("call id already open")
        task = asyncio.get_running_loop().create_task(self._run(identity, call_id, method, request))
        self.calls[(identity, call_id)] = task
        self.calls_total[method] += 1

    def _reject(self, exc: Exception) -> None:
        kind = "auth" if isinstance(exc, StreamAuthError) else "rejected"
        self.rejected[kind] += 1
        count = self.rejected[kind]
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood cannot flood the log
            log.warning("worker stream: dropped a message (%s: %s; %d so far)", kind, exc, count)

    # ---- one call --------------------------------------------------------------------

    async def _run(self, identity: bytes, call_id: int, method: str, request: Any) -> None:
        index, error = 0, None
        try:
            async with contextlib.aclosing(self._handlers[method](request)) as replies:
                async for reply in replies:
                    self._send(identity, {"t": CHUNK, "id": call_id, "i": index, "c": to_wire(reply)})
                    index += 1
        except _RouterGone:
            return  # nobody to tell; the generator is closed, the engine request aborted
        except asyncio.CancelledError:
            return
        except Exception as exc:  # noqa: BLE001 - reported to the router, which answers 5xx
            log.exception("request %s: %s failed", request.request_id, method)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.calls.pop((identity, call_id), None)
        with contextlib.suppress(_RouterGone):
            self._send(identity, {"t": END, "id": call_id, "i": index, "error": error})

    def _send(self, identity: bytes, message: dict) -> None:
        # Never waits: no high-water mark. An asyncio socket reports a failed send on the
        # future it returns, already done when the send failed at once.
        sent = self._sock.send_multipart([identity, *self._codec.seal(message)])
        if sent.done() and sent.exception() is not None:  # EHOSTUNREACH: that router left
            raise _RouterGone from sent.exception()
        sent.add_done_callback(_quiet)

    # ---- routers that went away ------------------------------------------------------

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.session_timeout_s / 2))
            now = time.monotonic()
            silent = {i for i, t in self._heard.items() if now - t > self.session_timeout_s}
            for (identity, call_id), task in list(self.calls.items()):
                if identity in silent:
                    log.warning("worker stream: router silent for %.0f s; cancelling call %d",
                                self.session_timeout_s, call_id)
                    task.cancel()
            for identity in silent:
                self._heard.pop(identity, None)


class _RouterGone(Exception):
    pass


def _quiet(future) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a late failure only means that router left
