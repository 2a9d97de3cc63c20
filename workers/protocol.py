"""Typed messages between the router and the worker deployments.

The router decides the route; the worker carries it out and reports the route it
actually took (a failed remote prefill falls back to local) on the first chunk, so the
router can set `x-pd-route` / `x-pd-reason` before any body byte is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import TokenLogprob

Route = Literal["local", "disagg"]

# The closed list of INTERFACES.md.
REASONS = (
    "forced", "profile", "short-prompt", "prefix-hit", "long-prompt", "prefill-busy",
    "prefill-unhealthy", "prefill-failed", "prefill-timeout", "decode-busy",
    # auto: the candidate with the most slack against the SLO; a background prefill that
    # keeps the streams beside it inside theirs; none meets it (least goodput lost); a
    # bounded re-probe of a route whose measurements went stale
    "slo-local", "slo-disagg", "protect-streams", "no-route-meets-slo", "explore",
)


@dataclass
class GenerateRequest:
    request_id: str  # the client's x-request-id (or generated); root of the transfer id
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # pinned by the router so the output does not depend on the route
    route: Route
    reason: str  # one of REASONS
    workload: str = "default"
    deadline: float | None = None  # time.time() after which the request is aborted
    prefill_timeout_s: float = 30.0  # remote prefill + transfer; then local fallback
    target_replica: str | None = None  # replica unique id the request router must pick
    prefill_replica: str | None = None  # for route == "disagg": the prefill replica to use
    prefill_address: str | None = None  # that prefill replica's worker stream, if it has one


@dataclass
class GenerateChunk:
    """One item of a worker's `generate` stream."""

    token_ids: list[int] = field(default_factory=list)  # new tokens since the last chunk
    text: str = ""  # new text since the last chunk (never a broken UTF-8 sequence)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # Set on the first chunk only: what the worker actually did.
    route: Route | None = None
    reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: dict | None = None  # OpenAI-shaped error body when finish_reason == "error"
    # As in the engine's `RequestOutput`: per new token, and the prompt's on the first chunk.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # which of the request's n sequences
    # Set on the first chunk with a token: seconds from the worker taking the call to that
    # chunk, on the worker's own clock (the router's TTFT less this is the hop between them)
    worker_ttft_s: float | None = None
    # Set on one chunk of a disaggregated request, the first after the prefill replica
    # replied (none when the stream ended first): its KV transfer's exposed tail
    # (`PrefillResult.tail_s`), which the router learns the link from at once, before the
    # replica's next report carries it
    transfer_tail_s: float | None = None


@dataclass
class PrefillRequest:
    """Decode worker -> prefill worker: compute this prompt's KV and send it to me."""

    request_id: str  # the client's x-request-id, for logs
    transfer_id: str  # request id + nonce, chosen by the decode worker; keys the transfer
    prompt_token_ids: list[int]
    params: SamplingParams  # the request's own; the prefill worker samples the first token (n > 1: one per sequence)
    seed: int
    decode_address: str  # the decode replica's advertised transport address
    start_block: int  # blocks the decode replica already holds (prefix cache) are not sent
    layout_fingerprint: str  # refuse at once when the two engines' KV would not match
    timeout_s: float = 30.0
    deadline: float | None = None
    target_replica: str | None = None  # the prefill replica the router chose


@dataclass
class PrefillResult:
    """Prefill worker -> decode worker, once every layer was acknowledged. The first token
    is not here: it travels with the last layer (`KVSink.on_complete`), which is what the
    decode side commits, without waiting for this reply, unless the request asked for
    prompt logprobs: those (prompt length x (K + 1) pairs, too large for a transport
    header) come here, and the decode side waits for them before its first output."""

    num_cached_tokens: int  # prompt tokens the prefill replica found in its prefix cache
    num_bytes: int  # KV bytes sent
    seconds: float  # prefill + transfer, on the prefill side
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with params.prompt_logprobs
    # from the prompt's last layer handed to the sender to the decode side's
    # acknowledgement: what the transfer added to time to first token (its record's
    # `tail_seconds`); None from a replica that does not say, or when no layer was sent
    tail_s: float | None = None


@dataclass
class StepsRequest:
    """Router -> any worker: its recent step and KV transfer records (`GET /admin/steps`)."""

    since: float = 0.0  # time.time(); records that started before it are left out
    limit: int = 1000  # the newest this many of each


@dataclass
class StepsReply:
    """A replica's recent records, oldest first: `StepRecord`s and `TransferRecord`s as maps."""

    role: str
    steps: list[dict] = field(default_factory=list)
    transfers: list[dict] = field(default_factory=list)
