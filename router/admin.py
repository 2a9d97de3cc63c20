"""The admin API: workload profiles, read and changed live; every replica's recent step
and KV transfer records (`GET /admin/steps`, fetched over the worker streams).

`Authorization: Bearer $PDC_ADMIN_TOKEN`; a missing or wrong token is 401, and with no
token configured the whole admin API is off (403). A change goes to the ControlPlane,
which every router replica polls, so it applies to new requests everywhere within 2 s.

The profiles carry one version for them all, sent as `ETag: "N"`; a PUT or DELETE with
`If-Match: N` (or `"N"`) is refused with 409 unless N is still the current version, so a
tool restoring profiles never overwrites a change made since it read them.
"""

from __future__ import annotations

import asyncio
import hmac
import math
from typing import Any

from pydantic import ValidationError

from cluster.config import WorkloadProfile
from router.cluster_view import ClusterView, ReplicaInfo
from router.control_plane import (
    DefaultWorkloadRequired,
    ProfileChangeRefused,
    UnknownWorkload,
    VersionConflict,
)
from router.errors import APIError, bad_request, from_validation_error
from workers.protocol import StepsRequest
from workers.stream.client import WorkerStreams

MAX_NAME_LEN = 64
MAX_VERSION_DIGITS = 18  # an If-Match longer than any version is refused before int() parses it
DEFAULT_STEPS_LIMIT = 1000  # records of each kind per replica
STEPS_TIMEOUT_S = 2.0  # a replica that has not answered by then is listed with an error
ENGINE_STATS = ("kv_blocks_total", "max_num_batched_tokens", "kv_bytes_per_token", "num_layers")  # heartbeat keys /admin/steps repeats


def check_admin(authorization: str | None, token: str | None) -> None:
    if not token:
        raise APIError(403, "The admin API is disabled (no admin token is configured)",
                       code="admin_disabled")
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise APIError(401, "Missing or invalid admin token", code="invalid_admin_token",
                       headers={"www-authenticate": "Bearer"})


def parse_profile(name: str, body: object) -> WorkloadProfile:
    """A full profile: every field of INTERFACES.md must be present."""
    if not name or len(name) > MAX_NAME_LEN:
        raise bad_request(f"workload name must be 1-{MAX_NAME_LEN} characters", param="name")
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object (a full workload profile)")
    required = ("mode", "min_remote_prefill_tokens", "max_prefill_queue", "allow_client_override")
    missing = [key for key in required if key not in body]
    if missing:
        raise bad_request(f"{missing[0]}: required in a full workload profile", param=missing[0])
    try:
        return WorkloadProfile.model_validate(body, strict=True)
    except ValidationError as e:
        raise from_validation_error(e) from None


def parse_if_match(value: str | None) -> int | None:
    """The version an `If-Match` header expects (`12` or `"12"`); None without the header."""
    if value is None:
        return None
    digits = value.strip()
    if len(digits) >= 2 and digits[0] == digits[-1] == '"':
        digits = digits[1:-1]
    if not digits.isascii() or not digits.isdigit() or len(digits) > MAX_VERSION_DIGITS:
        raise bad_request('If-Match must be a workloads version, e.g. 12 or "12" '
                          "(the ETag of GET /admin/workloads)", param="If-Match")
    return int(digits)


def etag(version: int) -> dict[str, str]:
    """The header that names the profiles' version an answer reflects."""
    return {"etag": f'"{version}"'}


def refused_error(refused: ProfileChangeRefused) -> APIError:
    """The HTTP answer to a profile write the ControlPlane refused."""
    name, current = refused.workload, refused.current_version
    if isinstance(refused, VersionConflict):
        return APIError(409, f"The workload profiles changed since you read them: the current version is "
                        f"{current}. GET /admin/workloads and retry with If-Match: {current}",
                        param="If-Match", code="version_conflict")
    if isinstance(refused, UnknownWorkload):
        return APIError(404, f"The workload '{name}' does not exist", param="name", code="workload_not_found")
    if isinstance(refused, DefaultWorkloadRequired):
        return bad_request("The 'default' workload cannot be deleted: it always exists (requests with an "
                           "unknown workload use it); PUT it to change it", param="name",
                           code="default_workload_required")
    raise AssertionError(f"unmapped refusal {type(refused).__name__}")


def parse_steps_query(query: dict[str, str]) -> StepsRequest:
    """`?since=<unix time>&limit=N`; 400 naming the bad parameter."""
    try:
        since = float(query.get("since", 0.0))
    except ValueError:
        raise bad_request("since must be a unix time in seconds", param="since") from None
    if not math.isfinite(since):
        raise bad_request("since must be a unix time in seconds", param="since")
    raw_limit = query.get("limit", str(DEFAULT_STEPS_LIMIT))
    if not raw_limit.isdigit():
        raise bad_request("limit must be a non-negative integer", param="limit")
    return StepsRequest(since, int(raw_limit))


def parse_limit(raw: str | None, maximum: int, default: int = 100) -> int:
    """`?limit=N` (0..`maximum`, `default` when absent); 400 naming the parameter."""
    if raw is None:
        return min(default, maximum)
    if not raw.isdigit() or int(raw) > maximum:
        raise bad_request(f"limit must be an integer from 0 to {maximum}", param="limit")
    return int(raw)


async def collect_steps(streams: WorkerStreams | None, view: ClusterView, req: StepsRequest,
                        timeout_s: float = STEPS_TIMEOUT_S, engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every known replica's records, asked concurrently; one that cannot answer (no
    worker stream, silent, failed) is listed with an `error` instead. `engine`: what the
    deployment's config says of its engines (model, device, dtype), added to the answer's."""
    replicas = list(view.replicas.values())
    answers = await asyncio.gather(*(_steps_of(streams, view.stream_address(r.replica_id), req, timeout_s)
                                     for r in replicas))
    return {"replicas": {r.replica_id: {"role": r.role, **_node_of(r), **_engine_of(r.stats), **answer}
                         for r, answer in zip(replicas, answers, strict=True)},
            # the router's engine settings (a pool may override them; its replicas' own
            # heartbeats give their KV pool and token budget under "engine")
            "engine": {"block_size": view.block_size, "max_num_seqs": view.max_num_seqs, **(engine or {})}}


def _node_of(replica: ReplicaInfo) -> dict[str, str]:
    """The replica's machine, where its heartbeats named one (the planner rates each
    node's streams from its own replicas' records)."""
    return {"node_id": replica.node_id} if replica.node_id else {}


def _engine_of(stats: dict[str, Any]) -> dict[str, Any]:
    """What a replica's last heartbeat said about its engine's limits, for `plan calibrate`."""
    engine = {key: stats[key] for key in ENGINE_STATS if key in stats}
    return {"engine": engine} if engine else {}


async def _steps_of(streams: WorkerStreams | None, address: str | None, req: StepsRequest,
                    timeout_s: float) -> dict[str, Any]:
    if streams is None or not address:
        return {"error": "no worker stream to this replica", "steps": [], "transfers": []}
    call = streams.call(address, req, "steps")
    try:
        async with asyncio.timeout(timeout_s):
            async for reply in call:
                return {"steps": reply.steps, "transfers": reply.transfers}
        return {"error": "the replica sent no records", "steps": [], "transfers": []}
    except Exception as exc:  # noqa: BLE001 - any failure is this replica's entry, never a 500
        return {"error": f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
                "steps": [], "transfers": []}
    finally:
        call.cancel()
