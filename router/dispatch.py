"""One request's call to a worker: place it, start it, wait for the first chunk, stream
the rest.

The ingress hands over a `RequestDraft` (the parsed request, its profile, timeouts);
`start` places it (router/placement.py), writes the `GenerateRequest` for the replica
chosen, and calls that replica. The first `GenerateChunk` carries the route actually
taken, so the HTTP headers are sent only after it arrives. A call that fails before any
chunk (the replica died, Serve has no replica) is placed again and retried once on
another replica; after that it is a 503. A worker's error chunk becomes the matching
OpenAI error.

A call goes over the worker stream (workers/stream/client.py) to the placed replica
when that replica advertised one, else through its deployment's Serve handle; both are
a `WorkerCall`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ray.exceptions import RayActorError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    RayServeException,
    ReplicaUnavailableError,
)

from cluster.config import WorkloadProfile
from router.cluster_view import ClusterView
from router.errors import APIError, RequestTimedOut, unavailable
from router.placement import Placement, PolicyInputs, place
from router.policy import RequestWork
from workers.engine.sampling_params import SamplingParams
from workers.protocol import GenerateChunk, GenerateRequest
from workers.stream.client import ReplicaGone, StreamCall, WorkerCallFailed, WorkerStreams

log = logging.getLogger("pdcluster.router")
RETRYABLE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, BackPressureError,
             RayServeException, ReplicaGone)
WORKER_FAILURES = (*RETRYABLE, WorkerCallFailed)  # after the first chunk: a 503, never a 500
DEADLINE_EXCEEDED = "deadline_exceeded"  # a worker's error code: the request's deadline passed


@runtime_checkable
class WorkerCall(Protocol):
    """A worker's `generate` stream as the router reads it, whichever way it travels: a
    `StreamCall` (workers/stream/client.py) or Serve's `DeploymentResponseGenerator`
    satisfy it as they are."""

    def __aiter__(self) -> AsyncIterator[GenerateChunk]: ...

    async def __anext__(self) -> GenerateChunk:
        """The next chunk; `StopAsyncIteration` after the last one."""
        ...

    def cancel(self) -> None:
        """Abort the call on the replica (the engine drops the request)."""
        ...


@dataclass(frozen=True)
class RequestDraft:
    """One parsed request, everything but where it runs: what `start` needs to place it
    and to write the `GenerateRequest` for the replica it lands on."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # pinned here so the output does not depend on the route or a retry
    workload: str
    profile: WorkloadProfile
    forced_mode: str | None  # a client `x-pd-mode` the profile allows
    offload_to_prefill: bool  # a prefill replica may run a local request whole
    prefill_timeout_s: float  # the worker's remote prefill + transfer, then local fallback
    first_chunk_timeout_s: float  # no first chunk by then: a 503
    policy: PolicyInputs = PolicyInputs()  # the objectives, learned corrections and clock it is routed by
    clock: Callable[[], float] = time.monotonic  # the policy's clock, read again at the first token

    def generate_request(self, placement: Placement, prefill_address: str | None) -> GenerateRequest:
        """What the placed replica's `generate` gets; the deadline runs from now."""
        decision, deadline_s = placement.decision, self.profile.deadline_s
        params = self.params
        if decision.yield_prefill:
            params = dataclasses.replace(params, yield_to_decode=True, prefill_chunk_tokens=decision.chunk_tokens)
        return GenerateRequest(
            request_id=self.request_id, prompt_token_ids=self.prompt_ids, seed=self.seed, params=params,
            route=decision.route, reason=decision.reason, workload=self.workload,
            deadline=time.time() + deadline_s if deadline_s else None, prefill_timeout_s=self.prefill_timeout_s,
            target_replica=placement.target_replica, prefill_replica=placement.prefill_replica,
            prefill_address=prefill_address)


@dataclass
class Callers:
    handles: dict  # deployment ("decode" | "prefill") -> Serve handle
    streams: WorkerStreams | None = None

    def prefill_address(self, placement: Placement, view: ClusterView) -> str | None:
        """The prefill replica's worker stream, for the decode worker to call it by;
        None when this router does not use worker streams."""
        return view.stream_address(placement.prefill_replica) if self.streams is not None else None

    def call(self, placement: Placement, request: GenerateRequest, view: ClusterView) -> WorkerCall | None:
        """The placed replica's stream when it has one, else its deployment's handle;
        None when neither exists."""
        address = view.stream_address(placement.target_replica)
        if self.streams is not None and address:
            return self.streams.call(address, request)
        handle = self.handles.get(placement.deployment)
        return None if handle is None else handle.options(stream=True).generate.remote(request)


@dataclass
class Call:
    placement: Placement
    stream: WorkerCall
    first: GenerateChunk
    view: ClusterView
    done: bool = False
    closed: bool = False

    @property
    def path(self) -> str:
        """How the call travels: "stream" (the worker stream) or "handle" (Serve)."""
        return "stream" if isinstance(self.stream, StreamCall) else "handle"

    @property
    def route(self) -> str:
        return self.first.route or self.placement.decision.route

    @property
    def reason(self) -> str:
        return self.first.reason or self.placement.decision.reason

    async def rest(self) -> AsyncIterator[GenerateChunk]:
        """The chunks after the first; always releases the call, cancels it if abandoned."""
        try:
            async for chunk in self.stream:
                self.view.streamed(self.placement, len(chunk.token_ids))
                yield chunk
            self.done = True
        finally:
            self.close()

    def close(self) -> None:
        """Idempotent: cancel the worker call if it did not finish, end the placement."""
        if self.closed:
            return
        self.closed = True
        if not self.done:
            self.done = True
            self.stream.cancel()  # aborts the engine request
        self.view.end(self.placement)


def error_status(error: dict) -> int:
    code, kind = error.get("code"), error.get("type")
    if kind == "invalid_request_error" or code == "context_length_exceeded":
        return 400
    return 503


def worker_error(error: dict) -> APIError:
    """The OpenAI error for a worker's error chunk body (a RequestTimedOut for a deadline)."""
    kind = RequestTimedOut if error.get("code") == DEADLINE_EXCEEDED else APIError
    return kind.from_body(error_status(error), {"error": error})


def _no_answer(exc: BaseException) -> APIError:
    """No first chunk: the call ended empty, or `first_chunk_timeout_s` passed (a timeout)."""
    kind = RequestTimedOut if isinstance(exc, asyncio.TimeoutError) else APIError
    return kind(503, f"The replica did not answer ({type(exc).__name__})", code="service_unavailable")


async def start(callers: Callers, view: ClusterView, draft: RequestDraft) -> Call:
    """Place, call, and wait for the first chunk; one retry on another replica."""
    last_error: Exception | None = None
    for _attempt in range(2):
        placement = place(view, draft.prompt_ids, draft.params.max_tokens, draft.profile, draft.forced_mode,
                          draft.offload_to_prefill, RequestWork.of(draft.params), draft.policy, keep_context=True)
        placement.request_id = draft.request_id  # one prompt of several carries a suffix
        request = draft.generate_request(placement, callers.prefill_address(placement, view))
        view.begin(placement)
        stream = callers.call(placement, request, view)
        if stream is None:
            view.end(placement)
            raise unavailable()
        try:
            first = await asyncio.wait_for(stream.__anext__(), draft.first_chunk_timeout_s)
        except (StopAsyncIteration, asyncio.TimeoutError) as e:
            stream.cancel()
            view.end(placement)
            raise _no_answer(e) from None
        except RETRYABLE as e:
            stream.cancel()
            view.end(placement)
            log.warning("request %s: %s failed before its first chunk: %r", request.request_id,
                        placement.target_replica, e)
            if placement.target_replica:
                view.excluded.add(placement.target_replica)
            last_error = e
            continue
        except WorkerCallFailed as e:
            stream.cancel()
            view.end(placement)
            log.error("request %s: %s failed: %s", request.request_id, placement.target_replica, e)
            raise APIError(503, "The serving replica failed; retry", code="replica_failed") from None
        except BaseException:
            stream.cancel()
            view.end(placement)
            raise
        # the first chunk comes after the prefill, wherever it ran
        view.prefill_done(placement, draft.clock(), len(first.token_ids))
        call = Call(placement, stream, first, view)
        if first.finish_reason == "error":
            call.close()
            raise worker_error(first.error or {})
        return call
    raise unavailable(f"No replica could take the request: {type(last_error).__name__}")
