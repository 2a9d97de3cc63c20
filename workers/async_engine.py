"""An asyncio front for the synchronous `LLMEngine`.

One thread owns the engine: it runs every engine call (add, abort, reserve/commit/cancel
KV) between steps, and steps while there is work, so the event loop never blocks on a
step. The one exception is a KV layer write from the transport: it copies into reserved
blocks on the transport's thread at once (a layer must not wait for the step in
progress), under a lock that closing the reservation also takes, so a write never lands
in blocks a cancel already freed.

Outputs go back to each request's asyncio queue with `loop.call_soon_threadsafe`; the
request's async generator merges whatever queued up into one `GenerateChunk` (the engine
already detokenized and applied the stop rules on its thread). Leaving the
generator early (client gone, Serve cancelled the call, deadline) aborts the request,
which frees its blocks before the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from workers.engine.kv_types import (
    ByteDigest,
    FirstToken,
    KVLayout,
    KVPayload,
    KVReservation,
    KVSink,
)
from workers.engine.request_ids import engine_request_id
from workers.engine.sampling_params import SamplingParams
from workers.protocol import GenerateChunk

if TYPE_CHECKING:  # the engine module pulls in transformers; workers build it lazily
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.sequence import RequestOutput, TokenLogprob

log = logging.getLogger(__name__)
T = TypeVar("T")
_Call = tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future[Any]]  # fn, args, result


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a step raised); the replica must be replaced."""


class DeadlineExceeded(Exception):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    # Outputs taken from the queue but not yet merged: a chunk carries one sequence
    # (`index`) of a request with n > 1, the others wait here for the next chunks.
    backlog: deque[RequestOutput | BaseException] = field(default_factory=deque)


class AsyncEngine:
    """The `LLMEngine` for asyncio callers, and the `KVTarget` a worker's receiver writes into."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.5, *,
                 on_queue_time: Callable[[float], None] | None = None) -> None:
        """`on_queue_time`: called on the event loop with each sequence's engine queue time
        (`RequestOutput.queue_s`) as its first output is read, for sequences prefilled here."""
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.on_queue_time = on_queue_time
        self._calls: deque[_Call] = deque()
        self._streams: dict[str, _Stream] = {}
        self._open_transfer_ids: set[str] = set()  # reservations neither committed nor cancelled
        self._kv_lock = threading.Lock()  # a layer write vs. closing its reservation
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- lifecycle -------------------------------------------------------------------

    def check_health(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine loop died: {self.error!r}")
        if not self._thread.is_alive() and not self._stopping:
            raise EngineDeadError("engine loop is not running")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ---- calls run on the engine thread ----------------------------------------------

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run `fn(*args)` on the engine thread before its next step."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.error is not None:
            fut.set_exception(EngineDeadError(f"engine loop died: {self.error!r}"))
            return fut
        self._calls.append((fn, args, fut))
        self._wake.set()
        if self.error is not None:  # died while we appended: nobody will run it
            self._fail_calls(EngineDeadError(f"engine loop died: {self.error!r}"))
        return fut

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    async def stats(self) -> dict[str, Any]:
        return await self.call(self.engine.stats)

    async def check_integrity(self) -> None:
        await self.call(self.engine.check_integrity)

    # ---- KV import: the `kv_types.KVTarget` a receiver writes into ---------------------

    @property
    def layout(self) -> KVLayout:
        return self.engine.layout

    async def reserve_kv(self, transfer_id: str, prompt_token_ids: list[int]) -> KVReservation | None:
        return await self.call(self._reserve, transfer_id, prompt_token_ids)

    def write_kv_layer(self, reservation: KVReservation, layer_idx: int, kv: KVPayload,
                       digest: ByteDigest | None = None) -> None:
        """For transport threads: copies on the calling thread and returns once the layer
        is written, or dropped because the reservation is closed already (its blocks may
        belong to another request now).

        Not on the engine thread: there a layer waited for the step in progress, so a
        busy decode replica took one step per layer to receive a prompt (and the
        receiver's socket thread, blocked meanwhile, served no other transfer). The
        copy touches only reserved blocks, which no running sequence reads or writes;
        `_kv_lock` makes it exclusive with closing that reservation."""
        with self._kv_lock:
            if reservation.transfer_id in self._open_transfer_ids:
                self.engine.write_kv_layer(reservation, layer_idx, kv, digest)

    def cancel_kv(self, reservation: KVReservation) -> None:
        """Free a reservation; safe from any thread, idempotent. It is closed to layer
        writes at once (waiting at most for a copy in progress); its blocks are freed on
        the engine thread before the next step."""
        if self._close(reservation):
            self.submit(self.engine.cancel_kv, reservation)

    @property
    def num_open_reservations(self) -> int:
        return len(self._open_transfer_ids)

    def _reserve(self, transfer_id: str, prompt_token_ids: list[int]) -> KVReservation | None:
        res = self.engine.reserve_kv(transfer_id, prompt_token_ids)
        if res is not None:
            with self._kv_lock:
                self._open_transfer_ids.add(transfer_id)
        return res

    def _close(self, res: KVReservation) -> bool:
        """Close a reservation to writers; False if it was closed already. Waits for a
        layer copy in progress, so no write lands after this returns."""
        with self._kv_lock:
            if res.transfer_id not in self._open_transfer_ids:
                return False
            self._open_transfer_ids.discard(res.transfer_id)
            return True

    def _commit(self, res: KVReservation, request_id: str, params: SamplingParams,
                first_token_id: int, seed: int, first_logprob: TokenLogprob | None,
                prompt_logprobs: list[TokenLogprob | None] | None = None,
                siblings: tuple[FirstToken, ...] = ()) -> None:
        if not self._close(res):
            raise RuntimeError(f"reservation {res.transfer_id!r} already closed")
        try:
            self.engine.commit_kv(res, request_id, params, first_token_id, seed=seed, first_logprob=first_logprob,
                                  prompt_logprobs=prompt_logprobs, siblings=siblings)
        except BaseException:
            self.engine.cancel_kv(res)  # idempotent: frees the blocks unless commit took them
            raise

    # ---- request streams -------------------------------------------------------------

    def new_request_id(self, request_id: str) -> str:
        """Engine-unique id: clients may reuse an x-request-id, retries reuse it too."""
        return engine_request_id(request_id)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       seed: int, *, kv_sink: KVSink | None = None,
                       deadline: float | None = None) -> AsyncIterator[GenerateChunk]:
        """Prefill locally and stream the output. `request_id` must be engine-unique. With a
        `kv_sink` the request does not fork here (its KV and first tokens go to the sink)."""
        add = lambda: self.engine.add_request(  # noqa: E731
            request_id, prompt_token_ids, params, kv_sink=kv_sink, seed=seed)
        async for chunk in self._stream(request_id, add, deadline, 1 if kv_sink is not None else params.n):
            yield chunk

    async def generate_from_kv(self, reservation: KVReservation, request_id: str,
                               params: SamplingParams, first_token_id: int, seed: int, *,
                               first_logprob: TokenLogprob | None = None,
                               prompt_logprobs: list[TokenLogprob | None] | None = None,
                               siblings: tuple[FirstToken, ...] = (),
                               deadline: float | None = None) -> AsyncIterator[GenerateChunk]:
        """Turn a fully received reservation into a running request and stream it. The
        first chunk is `first_token_id` (the prefill replica's token) with its text and
        `first_logprob` (and `prompt_logprobs`, from the prefill call's reply), the engine's
        first output for the request (`LLMEngine.commit_kv`)."""
        commit = lambda: self._commit(reservation, request_id, params, first_token_id, seed,  # noqa: E731
                                      first_logprob, prompt_logprobs, siblings)
        async for chunk in self._stream(request_id, commit, deadline, params.n):
            yield chunk

    async def _stream(self, request_id: str, start: Callable[[], None],
                      deadline: float | None, num_outputs: int = 1) -> AsyncIterator[GenerateChunk]:
        """Chunks of the request's `num_outputs` sequences (each chunk one `index`) until
        every one has finished, or any was aborted."""
        assert request_id not in self._streams, f"duplicate engine request id {request_id}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        finished = False
        num_finished = 0
        try:
            await self.call(start)
            while not finished:
                chunk = await self._next_chunk(stream, deadline)
                num_finished += chunk.finished
                finished = num_finished == num_outputs or chunk.finish_reason == "abort"
                if chunk.token_ids or chunk.text or chunk.finished:
                    yield chunk
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.submit(self._abort_quietly, request_id)

    async def _next_chunk(self, stream: _Stream, deadline: float | None) -> GenerateChunk:
        """Wait for the next engine output; all that queued up meanwhile for the same
        sequence become one chunk."""
        timeout = None if deadline is None else deadline - time.time()
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded
        if not stream.backlog:
            try:
                stream.backlog.append(await asyncio.wait_for(stream.queue.get(), timeout))
            except asyncio.TimeoutError:
                raise DeadlineExceeded from None
        while not stream.queue.empty():
            stream.backlog.append(stream.queue.get_nowait())
        for item in stream.backlog:
            if isinstance(item, BaseException):
                raise item
        index = stream.backlog[0].index
        items = [item for item in stream.backlog if item.index == index]
        stream.backlog = deque(item for item in stream.backlog if item.index != index)
        self._report_queue_times(items)
        chunk = GenerateChunk(index=index)
        for item in items:
            chunk.token_ids += item.new_token_ids
            if item.logprobs is not None:
                chunk.logprobs = (chunk.logprobs or []) + item.logprobs
            chunk.text += item.text
            chunk.prompt_logprobs = chunk.prompt_logprobs or item.prompt_logprobs
            chunk.finished, chunk.finish_reason = item.finished, item.finish_reason
            chunk.num_prompt_tokens = len(item.prompt_token_ids)
            chunk.num_cached_tokens = item.num_cached_tokens
        return chunk

    def _report_queue_times(self, outputs: list[RequestOutput]) -> None:
        if self.on_queue_time is None:
            return
        for output in outputs:
            if output.queue_s is not None:
                self.on_queue_time(output.queue_s)

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except KeyError:  # already finished and forgotten
            pass

    # ---- the engine thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._run_calls()
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                else:
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - any step failure kills the loop
            log.exception("engine loop died")
            self.error = exc
            self._fail_everything(exc)

    def _run_calls(self) -> None:
        while self._calls:
            fn, args, fut = self._calls.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def _fail_calls(self, exc: BaseException) -> None:
        while self._calls:
            try:
                _, _, fut = self._calls.popleft()
            except IndexError:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)

    def _fail_everything(self, exc: BaseException) -> None:
        dead = EngineDeadError(f"engine loop died: {exc!r}")
        self._fail_calls(dead)
        for stream in list(self._streams.values()):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, dead)

