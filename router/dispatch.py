"""One request's call to a worker: start it, wait for the first chunk, stream the rest.

The first `GenerateChunk` carries the route actually taken, so the HTTP headers are sent
only after it arrives. A call that fails before any chunk (the replica died, Serve has
no replica) is retried once on another replica; after that it is a 503. A worker's
error chunk becomes the matching OpenAI error.

A call goes over the worker stream (workers/stream/client.py) to the planned replica
when that replica advertised one, else through its deployment's Serve handle; both
give an async iterator of chunks with `cancel()`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray.exceptions import RayActorError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    RayServeException,
    ReplicaUnavailableError,
)

from router.errors import APIError, unavailable
from router.placement import ClusterView, RoutePlan
from workers.protocol import GenerateChunk, GenerateRequest
from workers.stream.client import ReplicaGone, StreamCall, WorkerCallFailed, WorkerStreams

log = logging.getLogger("pdcluster.router")
RETRYABLE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, BackPressureError,
             RayServeException, ReplicaGone)
WORKER_FAILURES = (*RETRYABLE, WorkerCallFailed)  # after the first chunk: a 503, never a 500


@dataclass
class Callers:
    handles: dict  # deployment ("decode" | "prefill") -> Serve handle
    streams: WorkerStreams | None = None

    def call(self, plan: RoutePlan, request: GenerateRequest, view: ClusterView):
        """The planned replica's stream when it has one, else its deployment's handle;
        None when neither exists."""
        address = view.stream_address(plan.target_replica)
        if self.streams is not None and address:
            return self.streams.call(address, request)
        handle = self.handles.get(plan.deployment)
        return None if handle is None else handle.options(stream=True).generate.remote(request)


@dataclass
class Call:
    plan: RoutePlan
    stream: object  # DeploymentResponseGenerator
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
        return self.first.route or self.plan.decision.route

    @property
    def reason(self) -> str:
        return self.first.reason or self.plan.decision.reason

    async def rest(self) -> AsyncIterator[GenerateChunk]:
        """The chunks after the first; always releases the call, cancels it if abandoned."""
        try:
            async for chunk in self.stream:  # type: ignore[attr-defined]
                yield chunk
            self.done = True
        finally:
            self.close()

    def close(self) -> None:
        """Idempotent: cancel the worker call if it did not finish, release the plan."""
        if self.closed:
            return
        self.closed = True
        if not self.done:
            self.done = True
            self.stream.cancel()  # type: ignore[attr-defined]  # aborts the engine request
        self.view.end(self.plan)


def error_status(error: dict) -> int:
    code, kind = error.get("code"), error.get("type")
    if kind == "invalid_request_error" or code == "context_length_exceeded":
        return 400
    return 503


async def start(callers: Callers, view: ClusterView, plan_fn, make_request, timeout_s: float) -> Call:
    """Plan, call, and wait for the first chunk; one retry on another replica."""
    last_error: Exception | None = None
    for _attempt in range(2):
        plan: RoutePlan = plan_fn()
        request: GenerateRequest = make_request(plan)
        view.begin(plan)
        stream = callers.call(plan, request, view)
        if stream is None:
            view.end(plan)
            raise unavailable()
        try:
            first = await asyncio.wait_for(stream.__anext__(), timeout_s)
        except (StopAsyncIteration, asyncio.TimeoutError) as e:
            stream.cancel()
            view.end(plan)
            raise unavailable(f"The replica did not answer ({type(e).__name__})") from None
        except RETRYABLE as e:
            stream.cancel()
            view.end(plan)
            log.warning("request %s: %s failed before its first chunk: %r", request.request_id,
                        plan.target_replica, e)
            if plan.target_replica:
                view.excluded.add(plan.target_replica)
            last_error = e
            continue
        except WorkerCallFailed as e:
            stream.cancel()
            view.end(plan)
            log.error("request %s: %s failed: %s", request.request_id, plan.target_replica, e)
            raise APIError(503, "The serving replica failed; retry", code="replica_failed") from None
        except BaseException:
            stream.cancel()
            view.end(plan)
            raise
        view.prefill_done(plan)  # the first chunk comes after the prefill, wherever it ran
        call = Call(plan, stream, first, view)
        if first.finish_reason == "error":
            call.close()
            raise APIError.from_body(error_status(first.error or {}), {"error": first.error or {}})
        return call
    raise unavailable(f"No replica could take the request: {type(last_error).__name__}")
