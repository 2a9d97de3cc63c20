"""The admin API: workload profiles, read and changed live.

`Authorization: Bearer $PDC_ADMIN_TOKEN`; a missing or wrong token is 401, and with no
token configured the whole admin API is off (403). A change goes to the ControlPlane,
which every router replica polls, so it applies to new requests everywhere within 2 s.
"""

from __future__ import annotations

import hmac

from pydantic import ValidationError

from cluster.config import WorkloadProfile
from router.errors import APIError, bad_request, from_validation_error

MAX_NAME_LEN = 64


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
