"""The decode deployment: one continuous batch over requests prefilled here and requests
whose KV a prefill replica computed and streamed into blocks reserved here.

For `route == "disagg"` this replica orchestrates (as Ray Serve LLM's pattern does):
reserve blocks, tell the receiver to expect the transfer, call the chosen prefill
replica, wait for the last layer and the first token, commit, stream. Every way that
can fail (no prefill replica, no room, prefill error, transfer error, timeout) ends in a
local prefill of the same request, reported with its reason; never a hang, never a leak:
the reservation is always either committed or cancelled.

A request with n > 1 is disaggregated too: the prefill replica samples every sequence's
first token (seeds seed + i) and they arrive with the last layer (`FirstToken.siblings`);
this engine forks the request. For `best_of > n` those first tokens carry their raw
logprobs, the start of each sequence's score.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

from ray import serve

from workers.engine.kv_types import FirstToken, KVReservation
from workers.engine.sequence import TokenLogprob
from workers.engine_worker import EngineWorker
from workers.kv_transport import make_receiver
from workers.protocol import GenerateChunk, GenerateRequest, PrefillRequest
from workers.stream.client import worker_streams

log = logging.getLogger("pdcluster.decode")


class RemotePrefillFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason  # one of the fallback reasons of INTERFACES.md


class DecodeWorker(EngineWorker):
    role = "decode"

    async def __init__(self, config, prefill=None, control_plane=None,
                       transport_key: str | None = None) -> None:
        await super().__init__(config, control_plane, transport_key)
        self.prefill_handle = prefill
        # Calls to prefill replicas that advertise a worker stream go over it (no Serve hop).
        self.prefill_streams = worker_streams(self.config, transport_key)
        self.receiver = make_receiver(self.config, self.engine, transport_key)
        self.start_heartbeat(self.receiver.address)

    @property
    def transport_address(self) -> str:
        return self.receiver.address

    async def stats(self) -> dict:
        stats = await super().stats()
        snap = self.receiver.metrics.snapshot()  # every backend's receiver counts
        stats.update({f"kv_rejections_{r}_total": n for r, n in snap["rejections_total"].items()})
        stats.update({f"kv_received_bytes_{p}_total": n for p, n in snap["bytes_total"].items()})
        return stats

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        stream = self._disagg(req) if req.route == "disagg" else self._local(req, "local", req.reason)
        async for chunk in self._tracked(stream):
            yield chunk

    async def _disagg(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        try:
            res, first, prompt_logprobs, call = await self._remote_prefill(req)
        except RemotePrefillFailed as exc:
            log.warning("request %s: remote prefill failed (%s: %s); prefilling locally",
                        req.request_id, exc.reason, exc)
            async for chunk in self._local(req, "local", exc.reason):
                yield chunk
            return
        # The prefill replica's token is the engine's first output for the request.
        request_id = self.engine.new_request_id(req.request_id)
        stream = self.engine.generate_from_kv(res, request_id, req.params, first.token_id, req.seed,
                                              first_logprob=first.logprob, prompt_logprobs=prompt_logprobs,
                                              siblings=first.siblings, deadline=req.deadline)
        told = False  # the transfer's tail goes back once, on the first chunk after the reply
        async for chunk in self.label_first(stream, req, "disagg", req.reason):
            if not told and call.done():
                chunk.transfer_tail_s, told = _tail_of(call), True
            yield chunk

    async def __del__(self) -> None:
        await super().__del__()
        if self.prefill_streams is not None:
            self.prefill_streams.close()

    async def _remote_prefill(
            self, req: GenerateRequest,
    ) -> tuple[KVReservation, FirstToken, list[TokenLogprob | None] | None, asyncio.Task]:
        """Returns (reservation, first token) with every layer written, or raises
        RemotePrefillFailed having released everything it took. The first token (with its
        logprob when the request asked for logprobs) comes
        with the last layer, from the receiver: the commit need not wait for the prefill
        call's reply, unless the request asked for prompt logprobs, which come in that
        reply (`PrefillResult.prompt_logprobs`) and are returned third. Fourth, the call,
        which may still be finishing (its reply says the transfer's tail)."""
        can_call = self.prefill_handle is not None or (req.prefill_address and self.prefill_streams)
        if not can_call or not req.prefill_replica:
            raise RemotePrefillFailed("prefill-unhealthy", "no prefill replica")
        transfer_id = f"{req.request_id}.{uuid.uuid4().hex[:12]}"
        res = await self.engine.reserve_kv(transfer_id, req.prompt_token_ids)
        if res is None:
            raise RemotePrefillFailed("decode-busy", "no free KV blocks for the transfer")
        try:
            self.receiver.expect(transfer_id, res, timeout=req.prefill_timeout_s)
        except Exception as exc:
            self.engine.cancel_kv(res)
            raise RemotePrefillFailed("prefill-failed", f"receiver refused: {exc}") from None
        # From here the receiver owns `res` until it hands it back with the first token;
        # on any failure it cancels `res` itself.
        call = self._call_prefill(req, transfer_id, res)
        try:
            first = await self._await_transfer(transfer_id, call, req.prefill_timeout_s)
            prompt_logprobs = None
            if req.params.prompt_logprobs is not None:
                prompt_logprobs = await self._await_prompt_logprobs(call, req.prefill_timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                self.receiver.cancel(transfer_id)
            self.engine.cancel_kv(res)  # idempotent; covers a cancel right after success
            call.cancel()
            raise
        call.add_done_callback(_retrieve_exception)  # may still be finishing; never awaited
        return res, first, prompt_logprobs, call

    @staticmethod
    async def _await_prompt_logprobs(call: asyncio.Task, timeout_s: float) -> list[TokenLogprob | None]:
        """The prefill call's reply carries the prompt logprobs; it follows the last layer's ack."""
        try:
            result = await asyncio.wait_for(asyncio.shield(call), timeout_s)
        except asyncio.TimeoutError:
            raise RemotePrefillFailed("prefill-timeout", "prefill reply did not come in time") from None
        except Exception as exc:  # noqa: BLE001 - any failure of the call falls back
            raise RemotePrefillFailed("prefill-failed", f"prefill replica: {exc!r}") from None
        if result.prompt_logprobs is None:
            raise RemotePrefillFailed("prefill-failed", "prefill replica sent no prompt logprobs")
        return result.prompt_logprobs

    def _call_prefill(self, req: GenerateRequest, transfer_id: str, res: KVReservation) -> asyncio.Task:
        prefill_req = PrefillRequest(
            request_id=req.request_id, transfer_id=transfer_id,
            prompt_token_ids=req.prompt_token_ids, params=req.params, seed=req.seed,
            decode_address=self.receiver.address, start_block=res.num_cached_blocks,
            layout_fingerprint=self.engine.layout.fingerprint(), timeout_s=req.prefill_timeout_s,
            deadline=req.deadline, target_replica=req.prefill_replica)
        if req.prefill_address and self.prefill_streams is not None:
            call = self.prefill_streams.call(req.prefill_address, prefill_req, "prefill")
            return asyncio.ensure_future(_only_reply(call))
        response = self.prefill_handle.prefill.remote(prefill_req)
        return asyncio.ensure_future(_await_response(response))

    async def _await_transfer(self, transfer_id: str, call: asyncio.Task, timeout_s: float) -> FirstToken:
        """The first token once every layer is in; a failed prefill call fails it at once."""
        from transport.base import TransferError, TransferTimeout

        transfer = asyncio.ensure_future(self.receiver.wait_async(transfer_id, timeout_s))
        try:
            done, _ = await asyncio.wait({transfer, call}, timeout=timeout_s + 1.0,
                                         return_when=asyncio.FIRST_COMPLETED)
            if call in done and call.exception() is not None and transfer not in done:
                raise RemotePrefillFailed("prefill-failed", f"prefill replica: {call.exception()!r}")
            if transfer not in done:
                await asyncio.wait({transfer}, timeout=timeout_s + 1.0)
            if not transfer.done():
                raise RemotePrefillFailed("prefill-timeout", "transfer did not finish in time")
            return transfer.result()
        except TransferTimeout as exc:
            raise RemotePrefillFailed("prefill-timeout", str(exc)) from None
        except TransferError as exc:
            raise RemotePrefillFailed("prefill-failed", f"{exc.kind}: {exc}") from None
        finally:
            transfer.cancel()


def _tail_of(call: asyncio.Task) -> float | None:
    """The transfer's tail from the prefill call's reply, once it came (it follows the
    last layer's acknowledgement by one message); None before, or when the call failed."""
    if not call.done() or call.cancelled() or call.exception() is not None:
        return None
    return call.result().tail_s


def _retrieve_exception(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("prefill call ended with %r after its transfer completed", task.exception())


async def _only_reply(call):
    """The one reply of a worker-stream call; cancelling this cancels the call there."""
    result = None
    try:
        async for reply in call:
            result = reply
    except BaseException:
        call.cancel()
        raise
    if result is None:
        raise RuntimeError("the prefill replica ended the call without a result")
    return result


async def _await_response(response):
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


DecodeDeployment = serve.deployment(name="DecodeWorker")(DecodeWorker)
