"""A Serve request router that sends a request to the replica the pdcluster router chose.

The Router ingress picks a replica itself (prefix affinity, then load, from its own
view of the cluster) and names it in `GenerateRequest.target_replica` (or
`PrefillRequest.target_replica`). Serve's default power-of-two router would ignore that
choice, so the worker deployments use this one (`request_router_config()`): the named
replica when it is still among the candidates, otherwise every candidate, least queued
first (the request still completes; only the cache affinity is lost).
"""

from __future__ import annotations

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

REQUEST_ROUTER_CLASS = "router.replica_router.TargetReplicaRouter"


def target_of(pending_request: PendingRequest | None) -> str | None:
    """The `target_replica` of the request's first argument, if it names one."""
    if pending_request is None:
        return None
    for arg in list(pending_request.args or ()) + list((pending_request.kwargs or {}).values()):
        target = getattr(arg, "target_replica", None)
        if isinstance(target, str) and target:
            return target
    return None


class TargetReplicaRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = target_of(pending_request)
        if target is not None:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if chosen:
                return [chosen]
        return [candidate_replicas]


def request_router_config() -> RequestRouterConfig:
    """For the worker deployments: `.options(request_router_config=request_router_config())`."""
    return RequestRouterConfig(request_router_class=REQUEST_ROUTER_CLASS)
