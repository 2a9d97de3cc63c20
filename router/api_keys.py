"""Optional API keys for `/v1/*`, from the file `PDC_API_KEYS_FILE` (or `secrets.api_keys_file`).

The file (YAML or JSON) maps each key to its tenant and workload profile:

    keys:
      sk-team-a: {tenant: team-a, workload: interactive}
      sk-batch:  {tenant: batch, workload: batch}

Without a file, `/v1/*` is open. With one, a request without a known key is 401.
Quotas per tenant (rate, concurrency) belong to the admission layer that reads the same
entries.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import yaml

from router.errors import APIError


@dataclass(frozen=True)
class ApiKey:
    tenant: str
    workload: str | None = None


class ApiKeys:
    def __init__(self, keys: dict[str, ApiKey]) -> None:
        self.keys = keys

    @classmethod
    def load(cls, path: Path | None) -> ApiKeys | None:
        if path is None:
            return None
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read the API keys file {path}: {e}") from None
        entries = data.get("keys", {}) if isinstance(data, dict) else {}
        if not isinstance(entries, dict):
            raise ValueError(f"API keys file {path}: `keys` must be a mapping")
        return cls({str(k): ApiKey(str((v or {}).get("tenant", "default")), (v or {}).get("workload"))
                    for k, v in entries.items()})

    def check(self, authorization: str | None) -> ApiKey:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() == "bearer":
            for key, entry in self.keys.items():  # constant time per key
                if hmac.compare_digest(key.encode(), given.strip().encode()):
                    return entry
        raise APIError(401, "Missing or invalid API key", code="invalid_api_key",
                       headers={"www-authenticate": "Bearer"})
