"""The prefill deployment: computes a prompt's KV and streams it, layer by layer, into
the blocks a decode replica reserved (`prefill`); it can also run a whole request where
it is (`generate`), so a prefill replica is not idle when disaggregation does not pay.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from ray import serve

from workers.engine.kv_types import KVSink
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import TokenLogprob
from workers.engine.transfer_cost import TransferTails
from workers.engine_worker import EngineWorker
from workers.faults import wrap_sender
from workers.kv_transport import make_sender
from workers.protocol import PrefillRequest, PrefillResult
from workers.transfer_waits import TransferWaits

log = logging.getLogger("pdcluster.prefill")


class PrefillWorker(EngineWorker):
    role = "prefill"

    async def __init__(self, config, control_plane=None, transport_key: str | None = None) -> None:
        await super().__init__(config, control_plane, transport_key)
        self.sender = wrap_sender(make_sender(self.config, transport_key), self.faults)  # as is unless faults.enabled
        # learns from the sender's records in stats(), forgetting samples older than the router's setting
        self.transfer_tails = TransferTails(self.replica_id, max_age_s=self.config.router.transfer_cost_max_age_s)
        self.transfer_waits = TransferWaits()  # computed, not yet acknowledged: a slow link before its records
        self.start_heartbeat()

    async def stats(self) -> dict:
        stats = await super().stats()
        pool = getattr(self.sender, "export_pool", None)  # the zmq-family senders lend export buffers
        if pool is not None:
            p = pool.stats()
            stats.update(export_pool_bytes=p["bytes_owned"], export_buffers_reused_total=p["num_reused"],
                         export_buffers_allocated_total=p["num_allocated"],
                         export_buffers_fallback_total=p["num_fallbacks"])
        self.transfer_tails.learn(getattr(self.sender, "transfer_records", ()))
        stats["transfer_model"] = self.transfer_tails.to_dict()  # per decode peer address, "*" pooled
        stats["transfer_waiting_s"] = self.transfer_waits.longest()  # per decode peer address
        return stats

    def stream_methods(self) -> dict:
        return {**super().stream_methods(), "prefill": self._prefill_once}

    async def _prefill_once(self, req: PrefillRequest) -> AsyncIterator[PrefillResult]:
        """`prefill` on the worker stream: one reply; a CANCEL cancels it like a Serve call."""
        yield await self.prefill(req)

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        """Prefill `req`, send its KV to `req.decode_address`, return once the decode side
        acknowledged every layer. Raises on any failure (the decode side falls back).
        Cancelling this call aborts the engine request, which aborts the transfer."""
        layout = self.engine.layout
        if req.layout_fingerprint != layout.fingerprint():
            raise ValueError(f"transfer {req.transfer_id}: KV layout differs from the decode replica's")
        start = time.perf_counter()
        sink = self.sender.open(req.transfer_id, req.decode_address, layout,
                                start_block=req.start_block, timeout=req.timeout_s)
        request_id = self.engine.new_request_id(req.request_id)
        num_cached, prompt_logprobs = await self._run_prompt(request_id, req, sink)
        self.transfer_waits.computed(req.transfer_id, req.decode_address)
        try:
            await sink.wait_async()
        finally:
            self.transfer_waits.acknowledged(req.transfer_id)
        seconds = time.perf_counter() - start
        num_blocks = layout.num_blocks(len(req.prompt_token_ids)) - req.start_block
        num_bytes = layout.layer_nbytes(max(num_blocks, 0)) * layout.num_layers
        self.metrics.record_transfer(num_bytes, seconds, self.sender.backend)
        log.info("request %s: prefilled %d tokens, sent %d bytes to %s in %.1f ms", req.request_id,
                 len(req.prompt_token_ids), num_bytes, req.decode_address, seconds * 1e3)
        return PrefillResult(num_cached, num_bytes, seconds, prompt_logprobs, tail_s=sink.tail_seconds)

    async def _run_prompt(self, request_id: str, req: PrefillRequest,
                          sink: KVSink) -> tuple[int, list[TokenLogprob | None] | None]:
        """Prefill and sample the first token, which the engine hands to `sink` with the
        last layer (`KVSink.on_complete`); returns the prompt tokens the prefix cache held
        and the prompt logprobs (when the request asked for them)."""
        self.num_inflight += 1
        try:
            token_ids: list[int] = []
            num_cached = 0
            prompt_logprobs = None
            async for chunk in self.engine.generate(request_id, req.prompt_token_ids,
                                                    prefill_params(req.params), req.seed,
                                                    kv_sink=sink, deadline=req.deadline):
                token_ids += chunk.token_ids
                num_cached = max(num_cached, chunk.num_cached_tokens)
                prompt_logprobs = prompt_logprobs or chunk.prompt_logprobs
            if not token_ids:
                raise RuntimeError(f"transfer {req.transfer_id}: prefill ended without a token")
            return num_cached, prompt_logprobs
        finally:
            self.num_inflight -= 1


def prefill_params(params: SamplingParams) -> SamplingParams:
    """Sample exactly the first token as the decode replica would have: same distribution
    and seed, EOS still masked when `min_tokens` asks for it, but stop after one token
    (with n > 1 the engine also samples the other sequences' first tokens, sent with the KV)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1),
                               stop=(), ignore_eos=params.ignore_eos)


PrefillDeployment = serve.deployment(name="PrefillWorker")(PrefillWorker)
