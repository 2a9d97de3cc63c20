"""The Router ingress: the whole HTTP API of INTERFACES.md on one FastAPI app.

Per request: parse and validate (400s), tokenise, resolve the workload profile, place the
request (`router/placement.py`), call the chosen worker and wait for its first chunk (which
carries the route actually taken), then answer with `x-pd-route` / `x-pd-reason` /
`x-request-id` and either an SSE stream or one JSON body. Profiles and the replica table
come from the ControlPlane, polled in the background.
"""

# No `from __future__ import annotations`: FastAPI must see real types on the endpoint
# signatures of a class that Serve pickles by value.

import asyncio
import logging
import random
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from cluster.config import ClusterConfig, WorkloadProfile, load_config
from router import (
    admin,
    admission,
    dispatch,
    gc_tuning,
    metrics,
    request_checks,
    sse,
    streaming,
    tokenizer_api,
)
from router.api_keys import ApiKeys
from router.cluster_view import ClusterView
from router.control_plane import ProfileChangeRefused
from router.decision_log import DECISION_LOG_SIZE, DecisionLog
from router.errors import (
    RequestTimedOut,
    bad_request,
    from_validation_error,
    model_not_found,
)
from router.http_errors import install_handlers
from router.learning import PolicyLearner
from router.logprob_format import TokenTexts
from router.metrics_fresh import cluster_metrics
from router.middleware import RequestIdMiddleware, read_json
from router.openai_fields import refused_field
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.profiles import Profiles, client_mode
from router.prompting import PromptBuilder
from router.responses import ResponseShape
from router.tenants import ANONYMOUS, Tenants
from workers.model_files import resolve_model_path  # makes a preset once per node, under a lock
from workers.stream.client import worker_streams

log = logging.getLogger("pdcluster.router")
METRICS_PUSH_INTERVAL_S = 2.0
# Note: Serve pickles the Router class by value when it is decorated, so every module-level
# name it uses must be defined above it.

def _parse(kind: str, body: Any) -> CompletionRequest | ChatCompletionRequest:
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object")
    refused = refused_field(kind, body)
    if refused is not None:
        raise refused
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def _start_all(callers, view, drafts: list) -> list:
    """Start every draft's call at once; if one fails, close the others and raise."""
    results = await asyncio.gather(*(dispatch.start(callers, view, d) for d in drafts), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for r in results:
            if not isinstance(r, BaseException):
                r.close()
        raise failed[0]
    return list(results)


def _pool_status(cluster: ClusterView, role: str, enabled: bool) -> dict[str, Any]:
    replicas = [r for r in cluster.replicas.values() if r.role == role]
    healthy = sum(r.healthy for r in replicas)
    status = "disabled" if not enabled and not replicas else "ok" if healthy else "down"
    return {"status": status, "healthy": healthy, "replicas": len(replicas)}


def _prediction_headers(prediction) -> dict[str, str]:
    """`x-pd-predicted-ttft-ms` / `-tpot-ms`: what the router expected of the route taken."""
    if prediction is None:
        return {}
    return {"x-pd-predicted-ttft-ms": f"{prediction.ttft_s * 1000.0:.2f}",
            "x-pd-predicted-tpot-ms": f"{prediction.tpot_s * 1000.0:.2f}"}


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (unit tests)
        return f"local-{random.getrandbits(32):08x}"


app = FastAPI(title="pdcluster", docs_url=None, redoc_url=None, openapi_url=None)
app.add_middleware(RequestIdMiddleware)
install_handlers(app)


@serve.deployment(name="Router", max_ongoing_requests=1000)
@serve.ingress(app)
class Router:
    async def __init__(self, config: dict | ClusterConfig, control_plane=None, decode=None, prefill=None,
                       transport_key: str | None = None) -> None:
        self.config = load_config(config)
        self.handles = {k: h for k, h in (("decode", decode), ("prefill", prefill)) if h is not None}
        self.streams = worker_streams(self.config, transport_key)
        self.control_plane = control_plane
        self.model = self.config.model.served_name
        self.prompts = PromptBuilder(resolve_model_path(self.config.model), self.config.model.max_model_len)
        self.texts = TokenTexts(self.prompts.tokenizer)
        engine = self.config.engine_for("decode")
        self.view = ClusterView(engine.block_size, engine.max_num_seqs, self.config.router.prefix_index_blocks)
        self.profiles = Profiles(0, dict(self.config.workloads))
        self.metrics = metrics.RouterMetrics(self.model)
        self.admin_token = self.config.secrets.admin_token()
        self.api_keys = ApiKeys.load(self.config.secrets.api_keys_path())
        limits = self.config.admission  # quotas per router replica (router/admission.py)
        self.admission = admission.Admission(
            Tenants.load(self.config.secrets.api_keys_path()).per_replica(self.config.router.num_replicas),
            limits.max_concurrent_requests, limits.max_queued_requests, limits.queue_timeout_s,
            observer=self.metrics)
        self.source_id = f"router:{_replica_id()}"
        self.learner = PolicyLearner(self.config.router, self.metrics, self.source_id)
        self.decisions = DecisionLog(clock=self.learner.clock)
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())
        gc_tuning.tune(self.config.router.gc_gen0_threshold)  # last: what start-up allocated is frozen

    # ---- cluster state ----------------------------------------------------------------

    async def _poll_forever(self) -> None:
        last_push = 0.0
        while True:
            try:
                await self._refresh()
                if time.monotonic() - last_push > METRICS_PUSH_INTERVAL_S:
                    await self._push_metrics()
                    last_push = time.monotonic()
            except Exception as e:  # noqa: BLE001 - the ControlPlane may be restarting
                log.debug("control plane poll failed: %r", e)
            await asyncio.sleep(self.config.router.state_poll_interval_s)

    async def _refresh(self) -> None:
        if self.control_plane is None:
            return
        state = await self.control_plane.get_state.remote(self.profiles.version)
        if state.profiles is not None:
            self.profiles = Profiles(state.version, {n: WorkloadProfile.model_validate(p)
                                                     for n, p in state.profiles.items()})
        self.view.update(state.replicas, self.learner.clock(), state.time)
        if self.streams is not None:
            self.streams.retain({a for r in state.replicas if (a := r.extra.get("stream_address"))})

    async def _push_metrics(self) -> None:
        if self.control_plane is not None:
            await self.control_plane.push_metrics.remote(self.source_id, metrics.snapshot(self.metrics.registry))

    def __del__(self) -> None:
        if getattr(self, "streams", None) is not None:
            self.streams.close()

    def check_health(self) -> None:
        if self._poller.done() and not self._poller.cancelled():
            raise RuntimeError(f"control plane poller died: {self._poller.exception()!r}")

    # ---- OpenAI API -------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authenticate(request)
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "pdcluster",
                "max_model_len": self.prompts.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def _generate(self, request: Request, kind: str) -> Response:
        arrival = time.perf_counter()
        key = self._authenticate(request)
        ticket = await self.admission.acquire(key.tenant if key else None)  # or 429
        try:
            response = await self._generate_admitted(request, kind, key, arrival)
        except BaseException:
            ticket.release()
            raise
        return admission.hold_until_sent(response, ticket)

    async def _generate_admitted(self, request: Request, kind: str, key, arrival: float) -> Response:
        body = await read_json(request, self.config.router.max_body_bytes)
        req = _parse(kind, body)
        self._check_model(req.model)
        if kind == "chat":
            prompts = [(self.prompts.chat_ids(req), "")]
        else:
            prompts = [(self.prompts.prompt_ids(p), self.prompts.prompt_text(p) if req.echo else "")
                       for p in req.prompts]
        request_checks.check_vocabulary_fields(req, self.prompts)
        workload = self.profiles.resolve(request.headers.get("x-workload"), key.workload if key else None,
                                         self.config.model.workload)
        profile = self.profiles.get(workload)
        forced = client_mode(profile, request.headers.get("x-pd-mode"))
        if not self.view.replicas:
            await self._refresh()  # first requests after a (re)start: do not wait for the poll
        request_id = request.state.request_id
        seed = req.seed if req.seed is not None else random.getrandbits(31)
        drafts = [dispatch.RequestDraft(
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}", prompt_ids=ids,
            params=req.sampling_params(request_checks.engine_max_tokens(
                req, len(ids), self.config.limits, self.prompts.max_model_len)),
            seed=seed, workload=workload, profile=profile, forced_mode=forced,
            offload_to_prefill=self.config.router.offload_local_to_prefill,
            prefill_timeout_s=self.config.router.prefill_timeout_s,
            first_chunk_timeout_s=self.config.router.request_timeout_s,
            policy=self.learner.inputs(request_id, profile), clock=self.learner.clock)
            for i, (ids, _) in enumerate(prompts)]
        tenant = key.tenant if key else ANONYMOUS
        calls = await self._start_calls(drafts, tenant, workload)
        for draft, call in zip(drafts, calls, strict=True):
            self.metrics.record_route(call.route, call.reason, workload)
            self.metrics.record_worker_call(call.path)
            self.decisions.record(draft.request_id, workload, call.placement)
        runs = [streaming.PromptRun(i, ids, text, call)
                for i, ((ids, text), call) in enumerate(zip(prompts, calls, strict=True))]
        headers = {"x-pd-route": calls[0].route, "x-pd-reason": calls[0].reason,
                   **_prediction_headers(calls[0].placement.decision.prediction)}
        shape = ResponseShape(
            kind, request_id, self.model, self.texts, req.return_token_ids, n=req.n,
            logprobs=req.logprob_counts()[0] is not None, echo=kind != "chat" and req.echo,
            drop_generated=req.max_tokens == 0)
        learn = None
        if len(calls) == 1:
            placement = calls[0].placement
            first = calls[0].first
            learn = lambda ttft, tpot, tail: self.learner.learn(  # noqa: E731
                placement, ttft, tpot, first.worker_ttft_s, tail)
        timing = streaming.Timing(self.metrics, calls[0].route, workload, arrival, learn, tenant=tenant)
        if req.stream:
            chunks = streaming.stream_sse(runs, shape, req.include_usage, timing)
            return StreamingResponse(chunks, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **headers})
        return await streaming.collect_json(runs, shape, timing, headers)

    async def _start_calls(self, drafts: list, tenant: str, workload: str) -> list:
        """Every draft's worker call, started; a time limit that ends one counts for `tenant`."""
        try:
            return await _start_all(dispatch.Callers(self.handles, self.streams), self.view, drafts)
        except RequestTimedOut:
            self.metrics.record_timeout(tenant, workload)
            raise

    # ---- tokenizer --------------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        self._authenticate(request)
        req = tokenizer_api.parse(tokenizer_api.TokenizeRequest,
                                  await read_json(request, self.config.router.max_body_bytes))
        self._check_model(req.model)
        return JSONResponse(tokenizer_api.tokenize(self.prompts, req))

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        self._authenticate(request)
        req = tokenizer_api.parse(tokenizer_api.DetokenizeRequest,
                                  await read_json(request, self.config.router.max_body_bytes))
        self._check_model(req.model)
        return JSONResponse(tokenizer_api.detokenize(self.prompts, req))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise model_not_found(model)

    def _authenticate(self, request: Request):
        if self.api_keys is None:
            return None
        return self.api_keys.check(request.headers.get("authorization"))

    # ---- health and metrics -----------------------------------------------------------

    @app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            await self._refresh()
        except Exception as e:  # noqa: BLE001 - answer from the last known state
            log.debug("health refresh failed: %r", e)
        pools = {role: _pool_status(self.view, role, pool.enabled)
                 for role, pool in (("decode", self.config.decode), ("prefill", self.config.prefill))}
        can_serve = pools["decode"]["healthy"] > 0 or pools["prefill"]["healthy"] > 0
        degraded = any(p["status"] != "ok" for p in pools.values() if p["status"] != "disabled")
        status = "unavailable" if not can_serve else "degraded" if degraded else "ok"
        body = {"status": status, "model": self.model, "pools": pools,
                "workloads_version": self.profiles.version}
        return JSONResponse(body, status_code=200 if can_serve else 503)

    @app.get("/metrics")
    async def prometheus(self, fresh: bool = False) -> Response:
        """Summed over every replica and router; `fresh=true` first waits (a few seconds
        at most) for each one's next push, so that the text holds all observed so far."""
        own, headers = metrics.snapshot(self.metrics.registry), {}
        try:
            text, headers = await cluster_metrics(self.control_plane, self.source_id, own, fresh)
        except Exception as e:  # noqa: BLE001 - still show this router's own metrics
            log.warning("metrics from the control plane failed: %r", e)
            text = metrics.render(own)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8", headers=headers)

    # ---- admin ------------------------------------------------------------------------

    @app.get("/admin/workloads")
    async def admin_get_workloads(self, request: Request) -> JSONResponse:
        admin.check_admin(request.headers.get("authorization"), self.admin_token)
        version, profiles = await self._profiles_from_control_plane()
        return JSONResponse({"version": version, "workloads": profiles}, headers=admin.etag(version))

    @app.put("/admin/workloads/{name}")
    async def admin_put_workload(self, name: str, request: Request) -> JSONResponse:
        admin.check_admin(request.headers.get("authorization"), self.admin_token)
        expected = admin.parse_if_match(request.headers.get("if-match"))
        profile = admin.parse_profile(name, await read_json(request, self.config.router.max_body_bytes))
        version = await self._change_profiles(self.control_plane.set_profile.remote(
            name, profile.model_dump(), expected))
        log.info("workload %s set to %s (version %d)", name, profile.model_dump(), version)
        return JSONResponse({"name": name, "profile": profile.model_dump(), "version": version},
                            headers=admin.etag(version))

    @app.delete("/admin/workloads/{name}")
    async def admin_delete_workload(self, name: str, request: Request) -> JSONResponse:
        admin.check_admin(request.headers.get("authorization"), self.admin_token)
        expected = admin.parse_if_match(request.headers.get("if-match"))
        version = await self._change_profiles(self.control_plane.delete_profile.remote(name, expected))
        log.info("workload %s deleted (version %d)", name, version)
        return JSONResponse({"name": name, "deleted": True, "version": version}, headers=admin.etag(version))

    @app.get("/admin/steps")
    async def admin_get_steps(self, request: Request) -> JSONResponse:
        admin.check_admin(request.headers.get("authorization"), self.admin_token)
        query = admin.parse_steps_query(dict(request.query_params))
        model = self.config.model
        device = model.device or ("cuda" if self.config.decode.num_gpus > 0 else "cpu")
        return JSONResponse(await admin.collect_steps(self.streams, self.view, query, engine={
            "model": model.served_name, "device": device, "dtype": model.dtype}))

    @app.get("/admin/policy")
    async def admin_get_policy(self, request: Request) -> JSONResponse:
        admin.check_admin(request.headers.get("authorization"), self.admin_token)
        return JSONResponse(self.learner.describe(self.view))

    @app.post("/admin/policy/reset")
    async def admin_reset_policy(self, request: Request) -> JSONResponse:
        admin.check_admin(request.headers.get("authorization"), self.admin_token)
        self.learner.reset()
        self.decisions.clear()
        return JSONResponse(self.learner.describe(self.view))

    @app.get("/admin/decisions")
    async def admin_get_decisions(self, request: Request) -> JSONResponse:
        admin.check_admin(request.headers.get("authorization"), self.admin_token)
        limit = admin.parse_limit(request.query_params.get("limit"), DECISION_LOG_SIZE)
        return JSONResponse({"router": self.source_id, "decisions": self.decisions.read(limit)})

    async def _change_profiles(self, change) -> int:
        """Await a ControlPlane profile write; its refusal becomes the HTTP error (409/404/400)."""
        try:
            version = await change
        except ProfileChangeRefused as refused:
            error = admin.refused_error(refused)
            log.info("workload %s change refused: %s", refused.workload, error.code)
            raise error from None
        await self._refresh()  # this replica at once; the others within one poll
        return version

    async def _profiles_from_control_plane(self) -> tuple[int, dict[str, Any]]:
        if self.control_plane is None:
            return self.profiles.version, self.profiles.as_dict()
        return await self.control_plane.get_profiles.remote()
