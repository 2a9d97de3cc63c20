"""What the prefill and decode deployments share: an engine, local generation, health,
live settings, and the heartbeat that tells the ControlPlane who this replica is and how
loaded it is (with its metrics, which the ControlPlane sums for `/metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar

from cluster.config import ClusterConfig, PoolConfig, load_config
from workers import invariants
from workers.async_engine import AsyncEngine, DeadlineExceeded, EngineDeadError
from workers.faults import FaultState
from workers.metrics import WorkerMetrics
from workers.model_files import resolve_model_path
from workers.protocol import GenerateChunk, GenerateRequest, StepsReply, StepsRequest
from workers.stream.server import StreamServer

if TYPE_CHECKING:  # imported where the engine is built: it pulls in transformers
    from workers.engine.llm_engine import LLMEngine

log = logging.getLogger("pdcluster.worker")
HEARTBEAT_INTERVAL_S = 0.5


class EngineWorker:
    role: ClassVar[str] = "decode"

    async def __init__(self, config: dict | ClusterConfig, control_plane=None,
                       transport_key: str | None = None) -> None:
        self.config = load_config(config)
        logging.getLogger("pdcluster").setLevel(self.config.log_level)
        self.control_plane = control_plane
        self.replica_id, self.node_id = _replica_identity()
        self.metrics = WorkerMetrics(self.config.model.served_name, self.role, self.replica_id)
        self.engine = AsyncEngine(await asyncio.to_thread(self._build_engine),
                                  on_queue_time=self.metrics.observe_engine_queue)
        self.num_inflight = 0
        self._heartbeat_task: asyncio.Task | None = None
        self._closed = False
        self.faults = FaultState(self.config.faults)  # inert unless the config enables it
        self.stream_server = self._start_stream_server(transport_key)

    def _start_stream_server(self, transport_key: str | None) -> StreamServer | None:
        """`generate` for routers over ZeroMQ (workers/stream/server.py), unless configured off."""
        if not self.config.router.worker_stream:
            return None
        from workers.kv_transport import stream_codec, stream_host

        return StreamServer(self.stream_methods(), stream_codec(transport_key),
                            stream_host(self.config)).start()

    def stream_methods(self) -> dict:
        """What this replica serves on its worker stream (a prefill replica adds `prefill`)."""
        return {"generate": self.generate, "steps": self._steps_once}

    async def _steps_once(self, req: StepsRequest) -> AsyncIterator[StepsReply]:
        """`steps` on the worker stream: one reply with the recent records."""
        yield self.recent_records(req.since, req.limit)

    def recent_records(self, since: float = 0.0, limit: int = 1000) -> StepsReply:
        """The engine's step records and the KV sender's transfer records (a prefill
        replica's) that ended at or after `since`, the newest `limit` of each, oldest first."""
        sender = getattr(self, "sender", None)
        return StepsReply(self.role, _recent(self.engine.engine.step_records, since, limit),
                          _recent(getattr(sender, "transfer_records", ()), since, limit))

    def _build_engine(self) -> LLMEngine:
        import torch

        from workers.engine.llm_engine import LLMEngine

        pool = self._pool_config()
        if pool.torch_threads:
            torch.set_num_threads(pool.torch_threads)
        settings = self.config.engine_for(self.role).model_dump()  # type: ignore[arg-type]
        warm_up = settings.pop("warmup")
        model = self.config.model
        engine = LLMEngine(str(resolve_model_path(self.config.model)), **settings,
                           device=model.device, dtype=model.dtype, node_activity=self._node_activity())
        if warm_up:  # the router predicts this replica's steps from the fit in its heartbeats
            t0 = time.perf_counter()
            coefficients = engine.warmup()
            log.info("%s replica %s warmed up in %.2f s: step model %s", self.role, self.replica_id,
                     time.perf_counter() - t0, coefficients.to_dict())
        return engine

    def _node_activity(self):
        """This replica's slot on its node's activity board (step records then say how busy
        the node's other engines were); None, logged, where no board can be made."""
        from workers.engine.node_activity import NodeActivity

        try:
            return NodeActivity(self.node_id)
        except OSError as exc:
            log.warning("no node activity board (%r): step records will not see the node's other engines", exc)
            return None

    def _pool_config(self) -> PoolConfig:
        return self.config.prefill if self.role == "prefill" else self.config.decode

    def start_heartbeat(self, address: str | None = None) -> None:
        """Register with the ControlPlane and keep heartbeating (no-op without one)."""
        if self.control_plane is not None and self._heartbeat_task is None:
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat_loop(address))

    # ---- Serve hooks -----------------------------------------------------------------

    def check_health(self) -> None:
        """Raising marks this replica unhealthy; Serve replaces it."""
        self.engine.check_health()

    def reconfigure(self, user_config: dict | None) -> None:
        """Live settings from a Serve redeploy: `{"log_level": "DEBUG"}`."""
        level = (user_config or {}).get("log_level")
        if level:
            logging.getLogger("pdcluster").setLevel(level)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """For Serve's autoscaler: the calls that came over the worker stream, which its
        handles never saw (workers/autoscaling.py adds them to its count)."""
        from workers.autoscaling import STREAM_CALLS

        return {STREAM_CALLS: float(len(self.stream_server.calls) if self.stream_server else 0)}

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve's request router may read about this replica's load."""
        return {"num_inflight": self.num_inflight, "role": self.role}

    async def stats(self) -> dict:
        stats = await self.engine.stats()
        stats.update(num_inflight=self.num_inflight,
                     num_open_reservations=self.engine.num_open_reservations)
        if self.stream_server is not None:
            server = self.stream_server
            stats.update(num_stream_calls=len(server.calls), num_stream_rejected=sum(server.rejected.values()),
                         **{f"stream_{m}_calls_total": n for m, n in server.calls_total.items()})
        return stats

    async def check_integrity(self) -> dict:
        """For tests and the fault suite: the engine's invariants hold and nothing leaked."""
        await self.engine.check_integrity()
        return await self.stats()

    async def debug_state(self, probe=None) -> dict:  # noqa: ARG002 - `probe.target_replica` pins the replica
        """Invariants plus every counter that must be zero when idle (workers/invariants.py)."""
        return await invariants.debug_state(self)

    def set_faults(self, spec: dict, probe=None) -> dict:  # noqa: ARG002 - as above
        """Switch the injected fault; refused unless the config's `faults.enabled`."""
        return self.faults.set(spec)

    # ---- generation ------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Prefill here and stream; the first chunk says route=local with the router's reason."""
        async for chunk in self._tracked(self._local(req, "local", req.reason)):
            yield chunk

    async def _local(self, req: GenerateRequest, route: str, reason: str) -> AsyncIterator[GenerateChunk]:
        request_id = self.engine.new_request_id(req.request_id)
        stream = self.engine.generate(request_id, req.prompt_token_ids, req.params, req.seed,
                                      deadline=req.deadline)
        async for chunk in self.label_first(stream, req, route, reason):
            yield chunk

    async def label_first(self, stream: AsyncIterator[GenerateChunk], req: GenerateRequest,
                          route: str, reason: str) -> AsyncIterator[GenerateChunk]:
        """Stamp the route on the first chunk; turn failures into one error chunk."""
        first = True
        try:
            async for chunk in stream:
                if first:
                    chunk.route, chunk.reason, first = route, reason, False
                    chunk.num_prompt_tokens = len(req.prompt_token_ids)
                yield chunk
        except (ValueError, DeadlineExceeded, EngineDeadError) as exc:
            log.warning("request %s failed: %s", req.request_id, exc)
            yield error_chunk(exc, route if first else None, reason if first else None,
                              len(req.prompt_token_ids))

    async def _tracked(self, stream: AsyncIterator[GenerateChunk]) -> AsyncIterator[GenerateChunk]:
        """Count the call in flight; stamp the first chunk with a token with the seconds
        since the call came in (`GenerateChunk.worker_ttft_s`)."""
        self.num_inflight += 1
        started, stamped = time.perf_counter(), False
        try:
            async for chunk in stream:
                if not stamped and chunk.token_ids:
                    chunk.worker_ttft_s, stamped = time.perf_counter() - started, True
                yield chunk
        finally:
            self.num_inflight -= 1

    # ---- heartbeat -------------------------------------------------------------------

    async def _heartbeat_loop(self, address: str | None) -> None:
        registered = False
        while not self._closed:
            try:
                if not registered:
                    await self.control_plane.register.remote(
                        replica_id=self.replica_id, role=self.role, node_id=self.node_id,
                        address=address, layout_fingerprint=self.engine.layout.fingerprint(),
                        stream_address=self.stream_server.address if self.stream_server else None)
                    registered = True
                stats = await self.stats()
                self.metrics.update_from_stats(stats)
                healthy = self.engine.error is None
                registered = await self.control_plane.heartbeat.remote(
                    self.replica_id, dict(stats, healthy=healthy), self.metrics.render())
            except Exception as exc:  # noqa: BLE001 - the ControlPlane may be restarting
                log.debug("heartbeat from %s failed: %r", self.replica_id, exc)
                registered = False
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def __del__(self) -> None:
        """Serve's graceful shutdown (scale-down, redeploy). Serve waits only for the calls
        it routed, so: leave the registry (routers stop choosing this replica at their
        next poll), refuse new stream calls (their routers retry elsewhere), let the open
        ones finish within Serve's shutdown budget, then stop the engine."""
        self._closed = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        if self.control_plane is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.control_plane.deregister.remote(self.replica_id), 1.0)
        if self.stream_server is not None:
            left = await self.stream_server.drain(self._pool_config().stream_drain_s)
            if left:
                log.warning("shutting down with %d stream calls still open", left)
            self.stream_server.close()
        with contextlib.suppress(Exception):
            self.engine.shutdown(timeout_s=1.0)
        activity = self.engine.engine.node_activity
        if activity is not None:
            with contextlib.suppress(Exception):
                activity.close()


def error_chunk(exc: BaseException, route: str | None, reason: str | None,
                num_prompt_tokens: int) -> GenerateChunk:
    """One OpenAI-shaped error as the last chunk of a stream."""
    if isinstance(exc, DeadlineExceeded):
        body = {"message": "request deadline exceeded", "type": "timeout_error",
                "param": None, "code": "deadline_exceeded"}
    elif isinstance(exc, EngineDeadError):
        body = {"message": "the serving replica failed; retry", "type": "service_unavailable",
                "param": None, "code": "replica_failed"}
    else:
        message = str(exc)
        code = "context_length_exceeded" if "context length" in message or "KV pool" in message else None
        body = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return GenerateChunk(finished=True, finish_reason="error", error=body, route=route,
                         reason=reason, num_prompt_tokens=num_prompt_tokens)


def _replica_identity() -> tuple[str, str]:
    """(Serve replica unique id, Ray node id); made-up ids outside Serve (unit tests)."""
    try:
        import ray
        from ray import serve

        replica_id = serve.get_replica_context().replica_id.unique_id
        return replica_id, ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return f"local-{uuid.uuid4().hex[:8]}", f"node-{os.getpid()}-{int(time.time())}"


def _recent(records, since: float, limit: int) -> list[dict]:
    # by end, as each is recorded when it ends: a poll then misses none that ended after
    # the last one, however long it ran (a transfer over a slow link takes seconds)
    kept = [r for r in list(records) if r.ended_at >= since]  # list(): one atomic copy of the deque
    return [dataclasses.asdict(r) for r in kept[max(0, len(kept) - limit):]]

